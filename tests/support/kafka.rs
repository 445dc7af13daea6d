//! A real Kafka-protocol broker (tansu, memory storage) on a free loopback port, and a
//! consumer that reads a topic back. `scripts/test` installs tansu; without it, tests fail.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use rdkafka::{
    ClientConfig, Message,
    consumer::{BaseConsumer, Consumer},
    message::{Headers, OwnedMessage},
};

pub struct Tansu {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

fn binary() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    for candidate in [PathBuf::from("tansu"), home.join(".cargo/bin/tansu")] {
        if Command::new(&candidate)
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
        {
            return candidate;
        }
    }
    panic!("tansu is not installed; scripts/test installs it (cargo install tansu)");
}

impl Tansu {
    pub fn start() -> Self {
        // tansu needs an explicit port that it also advertises.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(binary())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("tansu.log")).unwrap())
            .spawn()
            .expect("tansu starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not listen: {}",
                std::fs::read_to_string(dir.path().join("tansu.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            child,
            port,
            _dir: dir,
        }
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic with tansu's own CLI.
    pub fn create_topic(&self, name: &str, partitions: u32) {
        let status = Command::new(binary())
            .args([
                "topic",
                "create",
                "--broker",
                &format!("tcp://127.0.0.1:{}", self.port),
            ])
            .args(["--partitions", &partitions.to_string(), name])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "tansu topic create {name}");
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A consumed record: partition, offset, key, value (None for a tombstone), headers.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(self.value.as_ref().expect("a value")).unwrap()
    }
}

/// Reads `topic` from the earliest offset with a fresh consumer group until `n` records
/// arrived (or panics after 60 s). Records come per partition in offset order.
pub fn consume(brokers: &str, topic: &str, n: usize) -> Vec<Record> {
    consume_until(brokers, topic, &format!("{n} records"), |r| r.len() >= n)
}

/// Every record `topic` holds now (per partition in offset order): as many as its
/// partitions' watermarks say.
pub fn consume_all(brokers: &str, topic: &str, partitions: i32) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let n: i64 = (0..partitions)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            high - low
        })
        .sum();
    consume(brokers, topic, n as usize)
}

/// Reads `topic` from the beginning with a fresh consumer group until `done` says the
/// records read so far are enough (`what` names it in the failure after 60 s).
pub fn consume_until(
    brokers: &str,
    topic: &str,
    what: &str,
    done: impl Fn(&[Record]) -> bool,
) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("test-{}", std::process::id()) + &format!("-{:?}", Instant::now()),
        )
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(&out) {
        assert!(
            Instant::now() < deadline,
            "consumed {} records from {topic}, not yet {what}",
            out.len()
        );
        if let Some(result) = consumer.poll(Duration::from_millis(200)) {
            let m: OwnedMessage = result.expect("consume").detach();
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Record {
                partition: m.partition(),
                offset: m.offset(),
                key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                value: m.payload().map(<[u8]>::to_vec),
                headers,
            });
        }
    }
    out
}
