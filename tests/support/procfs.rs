//! What `/proc` says of a process, for the benches (shared by `tests/support` and
//! `benches/support`).

/// utime + stime of process `pid` (this process: `std::process::id()`), in seconds (the
/// kernel counts them in ticks of 10 ms); 0 when gone.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat; `after` starts at field 3.
    (ticks(11) + ticks(12)) / 100.0
}
