//! A real `nats-server` with JetStream on a free loopback port, for tests and benchmarks.
//! Killed on drop. `scripts/test` installs the Debian package; without it, tests fail loudly.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub struct NatsServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: String,
    pub port: u16,
}

fn binary() -> PathBuf {
    for candidate in [
        "nats-server",
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
    ] {
        if Command::new(candidate)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
        {
            return candidate.into();
        }
    }
    panic!("nats-server is not installed; scripts/test installs it (apt-get install nats-server)");
}

impl NatsServer {
    /// A server with JetStream (file storage) on a random port.
    pub fn start() -> Self {
        Self::with_config("")
    }

    /// A server with extra `nats-server.conf` lines (`max_payload: 4096`, `authorization {…}`).
    pub fn with_config(extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut server = Self {
            child: None,
            dir,
            extra: extra.to_owned(),
            port: 0,
        };
        server.spawn(None);
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("js")
    }

    fn spawn(&mut self, port: Option<u16>) {
        let dir = self.dir.path();
        let conf = dir.join("nats.conf");
        let listen = port.map_or("127.0.0.1:-1".to_string(), |p| format!("127.0.0.1:{p}"));
        std::fs::write(
            &conf,
            format!(
                "listen: \"{listen}\"\njetstream {{ store_dir: {:?} }}\n{}\n",
                self.store_dir(),
                self.extra
            ),
        )
        .unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "ports") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let child = Command::new(binary())
            .arg("-c")
            .arg(&conf)
            .arg("--ports_file_dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("nats.log")).unwrap())
            .spawn()
            .expect("nats-server starts");
        let ports = dir.join(format!("nats-server_{}.ports", child.id()));
        self.child = Some(child);
        self.port = wait_for_port(&ports, dir);
    }

    /// Stops the server (SIGTERM, wait).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) to the server: a frozen server keeps its connections
    /// open and answers nothing.
    pub fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("the server runs");
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal}");
    }

    /// Starts the stopped server again, on the same port and store.
    pub fn restart(&mut self) {
        self.restart_after(Duration::ZERO);
    }

    /// Stops the server, waits `down`, and starts it again on the same port and store.
    pub fn restart_after(&mut self, down: Duration) {
        self.stop();
        std::thread::sleep(down);
        let port = self.port;
        self.spawn(Some(port));
    }
}

fn wait_for_port(ports: &Path, dir: &Path) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(ports)
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && let Some(url) = v["nats"][0].as_str()
        {
            return url.rsplit(':').next().unwrap().parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "nats-server did not start: {}",
            std::fs::read_to_string(dir.join("nats.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Every message of `stream`, in stream order (none before it exists).
pub async fn read_stream(
    url: &str,
    stream: &str,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut s = match js.get_stream(stream).await {
        Ok(s) => s,
        Err(e) if e.to_string().contains("stream not found") => {
            return Vec::new();
        }
        Err(e) => panic!("cannot read stream {stream}: {e}"),
    };
    let state = s.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return out;
    }
    for seq in state.first_sequence..=state.last_sequence {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(m);
        }
    }
    out
}

/// Number of messages in `stream`.
pub async fn stream_len(url: &str, stream: &str) -> u64 {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(stream).await.unwrap();
    s.info().await.unwrap().state.messages
}
