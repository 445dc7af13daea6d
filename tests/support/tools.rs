//! The consumer tools (`tail`, `state`) run as a user runs them: the real binary, a config
//! file, a kubeconfig for the API test server, and a clean environment (other tests of the
//! same binary set `KEB_*` variables, which the config would read as overrides).

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
};

use serde_json::Value;

use super::{
    ApiServer,
    wait::{self, PATIENCE},
};

/// A config file (and a kubeconfig) for the tools.
pub struct Tools {
    _dir: tempfile::TempDir,
    config: PathBuf,
    kubeconfig: Option<PathBuf>,
}

impl Tools {
    /// Writes `config`; `api` is the cluster `--check` asks.
    pub fn new(config: &Value, api: Option<&ApiServer>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, serde_json::to_string(config).unwrap()).unwrap();
        let kubeconfig = api.map(|a| a.write_kubeconfig(dir.path()));
        Self {
            _dir: dir,
            config: path,
            kubeconfig,
        }
    }

    fn command(&self, tool: &str, sink: &str, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"));
        c.env_clear()
            .args([
                tool,
                "--config",
                self.config.to_str().unwrap(),
                "--sink",
                sink,
            ])
            .args(args);
        if let Some(k) = &self.kubeconfig {
            c.env("KUBECONFIG", k);
        }
        c
    }

    /// Runs `tool` to its end (blocking): exit code, stdout, stderr.
    pub fn run(&self, tool: &str, sink: &str, args: &[&str]) -> (Option<i32>, String, String) {
        let out = self.command(tool, sink, args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `tool` to its end with a terminal as its stdout and stderr (`script` from
    /// util-linux makes one); returns what the terminal showed.
    pub fn run_in_terminal(&self, tool: &str, sink: &str, args: &[&str]) -> String {
        let command = self.command(tool, sink, args);
        let line: Vec<String> = std::iter::once(command.get_program())
            .chain(command.get_args())
            .map(|a| a.to_str().unwrap().to_owned())
            .collect();
        let mut script = Command::new("script");
        script
            .env_clear()
            .args(["-qec", &line.join(" "), "/dev/null"]);
        if let Some(k) = &self.kubeconfig {
            script.env("KUBECONFIG", k);
        }
        let out = script.output().expect("script (util-linux) runs");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts `tail` on `sink`; its output is collected as it comes.
    pub fn tail(&self, sink: &str, args: &[&str]) -> Tail {
        let mut child = self
            .command("tail", sink, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let stderr: Arc<Mutex<String>> = Arc::default();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let readers = vec![
            std::thread::spawn({
                let lines = lines.clone();
                move || {
                    for l in BufReader::new(out).lines() {
                        lines.lock().unwrap().push(l.unwrap());
                    }
                }
            }),
            std::thread::spawn({
                let stderr = stderr.clone();
                move || {
                    for l in BufReader::new(err).lines() {
                        let mut s = stderr.lock().unwrap();
                        s.push_str(&l.unwrap());
                        s.push('\n');
                    }
                }
            }),
        ];
        Tail {
            child,
            lines,
            stderr,
            readers,
        }
    }
}

/// A running `tail`.
pub struct Tail {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Tail {
    /// Waits until it says what it reads (from then on, what is published is printed).
    pub async fn ready(&mut self) {
        let stderr = self.stderr.clone();
        wait::until("tail says it is reading", PATIENCE, async || {
            stderr.lock().unwrap().contains("Reading ")
        })
        .await;
    }

    /// Waits until it printed at least `n` lines.
    pub async fn printed(&self, n: usize) {
        let lines = self.lines.clone();
        let stderr = self.stderr.clone();
        wait::until(format!("tail printed {n} lines"), PATIENCE, async || {
            let have = lines.lock().unwrap().len();
            if have < n && stderr.lock().unwrap().contains("tail:") {
                panic!("tail failed: {}", stderr.lock().unwrap());
            }
            have >= n
        })
        .await;
    }

    /// Stops it as Ctrl-C does; returns its exit code, its lines and its stderr.
    pub fn interrupt(self) -> (Option<i32>, Vec<String>, String) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-INT", &pid])
                .status()
                .unwrap()
                .success()
        );
        self.finish()
    }

    /// Waits for it to end by itself; returns its exit code, its lines and its stderr.
    pub fn finish(mut self) -> (Option<i32>, Vec<String>, String) {
        let status = self.child.wait().unwrap();
        for r in self.readers.drain(..) {
            r.join().unwrap();
        }
        let lines = std::mem::take(&mut *self.lines.lock().unwrap());
        let stderr = std::mem::take(&mut *self.stderr.lock().unwrap());
        (status.code(), lines, stderr)
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CloudEvents of `tail --output json` lines, each checked against the published schema.
pub fn events(lines: &[String]) -> Vec<Value> {
    lines
        .iter()
        .map(|l| {
            let e: Value = serde_json::from_str(l).unwrap();
            super::schema::check_cloudevent(&e);
            e
        })
        .collect()
}
