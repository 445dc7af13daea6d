//! One replica of the service as a pod runs it: the binary with its own config file, identity
//! and log file, stopped (and thawed, if frozen) when dropped.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use serde_json::Value;

pub struct Replica {
    pub identity: String,
    pub child: Child,
    log: PathBuf,
}

impl Replica {
    /// Starts the binary with `config` (written to `dir/{identity}.yaml`), its log at
    /// `dir/{identity}.log`.
    pub fn start(dir: &Path, identity: &str, config: &Value, kubeconfig: &Path) -> Self {
        let cfg = dir.join(format!("{identity}.yaml"));
        std::fs::write(&cfg, config.to_string()).unwrap();
        let log = dir.join(format!("{identity}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
            .args(["run", "--config", cfg.to_str().unwrap()])
            .env("KUBECONFIG", kubeconfig)
            // REPLICA_RUST_LOG: another filter, for a bench to look closer.
            .env(
                "RUST_LOG",
                std::env::var("REPLICA_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            // The tests read its log as lines (`admin=`, `Became leader`), not JSON.
            .env("KEB_LOG__FORMAT", "pretty")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self {
            identity: identity.to_owned(),
            child,
            log,
        }
    }

    /// Its log so far (a file: no colour escapes).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, …).
    pub fn signal(&self, signal: &str) {
        Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    /// SIGTERM, as a Deployment scaling down sends, and waits for the exit.
    pub fn terminate(&mut self) {
        self.signal("TERM");
        let _ = self.child.wait();
    }

    /// Its admin address, from the "Started" log line.
    pub fn admin(&self) -> Option<SocketAddr> {
        admin_in(&self.log())
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The messages its sinks acknowledged (`keb_sink_published_total`, summed).
    pub async fn published(&self) -> u64 {
        let Some(addr) = self.admin() else {
            return 0;
        };
        super::metric_sum(addr, "keb_sink_published_total").await as u64
    }
}

/// The admin address a replica's log gives in its "Started" line.
pub fn admin_in(log: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains(" Started "))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("admin="))?
        .parse()
        .ok()
}

/// Whether the shards' holders (one per shard, `None` for a free one) spread over exactly
/// `replicas` live replicas: every shard held, none by one of `gone`, none holding more than
/// ⌈shards / replicas⌉.
pub fn shards_spread(holders: &[Option<String>], gone: &[String], replicas: usize) -> bool {
    let cap = holders.len().div_ceil(replicas);
    let mut per: std::collections::HashMap<&str, usize> = Default::default();
    for h in holders.iter().flatten() {
        *per.entry(h.as_str()).or_default() += 1;
    }
    holders
        .iter()
        .all(|h| h.as_ref().is_some_and(|h| !gone.contains(h)))
        && per.len() == replicas
        && per.values().all(|&c| c <= cap)
}

/// Prints what each replica's log says of its shards and leadership (and every warning),
/// newest first, for a failing test to show.
pub fn dump(replicas: &[Replica]) {
    for r in replicas {
        let log = r.log();
        let tail: Vec<&str> = log
            .lines()
            .rev()
            .filter(|l| {
                !l.contains(" INFO ")
                    || ["assigned", "Became", "Stopped", "Handing", "Took", "Lost"]
                        .iter()
                        .any(|w| l.contains(w))
            })
            .take(40)
            .chain(log.lines().rev().take(5))
            .collect();
        eprintln!("--- {} (newest first)\n{}", r.identity, tail.join("\n"));
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
