//! The progress line of long reads: messages read and the rate, redrawn on stderr at most a
//! few times a second, and only when stderr is a terminal (a script's stderr stays clean).

use std::{
    io::{IsTerminal, Write},
    time::{Duration, Instant},
};

/// How often the line is redrawn.
const EVERY: Duration = Duration::from_millis(250);

/// See the module docs.
#[derive(Debug)]
pub struct Progress {
    what: &'static str,
    enabled: bool,
    started: Instant,
    last_drawn: Option<Instant>,
    count: u64,
}

impl Progress {
    /// A progress line for reading `what` (`"messages"`), drawn when stderr is a terminal.
    pub fn new(what: &'static str) -> Self {
        Self::with(what, std::io::stderr().is_terminal())
    }

    /// A progress line drawn or not, as `enabled` says.
    pub fn with(what: &'static str, enabled: bool) -> Self {
        Self {
            what,
            enabled,
            started: Instant::now(),
            last_drawn: None,
            count: 0,
        }
    }

    /// Counts `n` more and redraws the line when it is due.
    pub fn add(&mut self, n: u64) {
        self.count += n;
        if self.enabled && self.last_drawn.is_none_or(|t| t.elapsed() >= EVERY) {
            self.last_drawn = Some(Instant::now());
            self.draw();
        }
    }

    /// How many were counted.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The text of the line: `12345 messages read (4321/s)`.
    pub fn line(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64();
        let rate = if secs > 0.0 {
            self.count as f64 / secs
        } else {
            0.0
        };
        format!("{} {} read ({rate:.0}/s)", self.count, self.what)
    }

    fn draw(&self) {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{}", self.line());
        let _ = err.flush();
    }

    /// Draws the final figures and ends the line (nothing when disabled).
    pub fn finish(&mut self) {
        if self.enabled {
            self.draw();
            let _ = writeln!(std::io::stderr());
            self.enabled = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_counts_and_gives_a_rate() {
        let mut p = Progress::with("messages", false);
        p.add(3);
        p.add(2);
        assert_eq!(p.count(), 5);
        let line = p.line();
        assert!(line.starts_with("5 messages read ("), "{line}");
        assert!(line.ends_with("/s)"), "{line}");
    }
}
