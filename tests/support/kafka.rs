//! Apache Kafka for tests and benches: a single KRaft node (broker and controller in one JVM)
//! on free loopback ports, started from the Maven Central jars that `scripts/test` copies into
//! `target/kafka/jars` and stopped on drop (envtest's shape: start, connect, stop). Also a
//! consumer that reads a topic back. Without the jars, a test fails naming the command to run.
//! [`Kafka::secured`] adds SASL (PLAIN, SCRAM-SHA-512, OAUTHBEARER) and TLS listeners.

use std::{
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use rdkafka::{
    ClientConfig,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer},
};

/// The cluster id every test node is formatted with (22 characters of base64: 16 bytes). A
/// log directory is never reused, so one id serves every node.
const CLUSTER_ID: &str = "a2ViLXRlc3QtY2x1c3Rlcg";

/// How long a node gets to format its storage and start (a JVM on two busy cores).
const START_PATIENCE: Duration = Duration::from_secs(120);

/// A running Apache Kafka node (KRaft, `process.roles=broker,controller`) with a PLAINTEXT
/// listener on loopback (and, started by [`Kafka::secured`], SASL and TLS ones). Killed, and its directory removed, on drop or when the process that
/// started it ends, however it ends (so [`Kafka::shared`]'s node, never dropped, goes too).
pub struct Kafka {
    /// The watchdog shell around the JVM ([`WATCHDOG`]).
    child: Child,
    /// Its standard input: closing it (drop, or the end of this process) kills the JVM.
    lifeline: Option<ChildStdin>,
    /// The PLAINTEXT listener's port (what [`Kafka::brokers`] names).
    pub port: u16,
    /// Properties, log directory and the node's output (`kafka.log`).
    dir: PathBuf,
    /// How long the start took: storage format, JVM start, first metadata answer.
    pub started_in: Duration,
    /// The SASL and TLS listeners, when started with [`KafkaOptions::secured`].
    pub secured: Option<Secured>,
}

/// How a [`Kafka`] node is started.
#[derive(Clone, Debug, Default)]
pub struct KafkaOptions {
    /// Also listen with SASL and TLS ([`Secured`]): a CA and a server certificate are made
    /// with `openssl`, SCRAM users are written at storage format.
    pub secured: bool,
}

/// The user PLAIN knows (a `user_…` entry of the listener's JAAS config).
pub const PLAIN_USER: (&str, &str) = ("alice", "plain-pw-7c41e9");
/// The SCRAM-SHA-512 user, created at storage format (`--add-scram`).
pub const SCRAM_USER: (&str, &str) = ("bob", "scram-pw-5d02b8");

/// The secured listeners of a node started with [`KafkaOptions::secured`]. SASL mechanisms
/// on both SASL listeners: PLAIN ([`PLAIN_USER`]), SCRAM-SHA-512 ([`SCRAM_USER`]) and
/// OAUTHBEARER with the broker's default validator, which accepts unsigned JWTs
/// (`{"alg":"none"}`) naming a `sub` and an `exp` in the future (meant for tests: Kafka's own
/// docs call it non-production). No authorizer: an authenticated client may do anything.
#[derive(Clone, Debug)]
pub struct Secured {
    /// SASL_PLAINTEXT listener.
    pub sasl_port: u16,
    /// SSL listener (server certificate only, no client authentication).
    pub ssl_port: u16,
    /// SASL_SSL listener.
    pub sasl_ssl_port: u16,
    /// PEM of the CA that signed the server certificate (for `127.0.0.1` and `localhost`).
    pub ca_file: PathBuf,
}

impl Secured {
    /// `127.0.0.1:PORT` of the SASL_PLAINTEXT listener.
    pub fn sasl(&self) -> String {
        format!("127.0.0.1:{}", self.sasl_port)
    }

    /// `127.0.0.1:PORT` of the SSL listener.
    pub fn ssl(&self) -> String {
        format!("127.0.0.1:{}", self.ssl_port)
    }

    /// `127.0.0.1:PORT` of the SASL_SSL listener.
    pub fn sasl_ssl(&self) -> String {
        format!("127.0.0.1:{}", self.sasl_ssl_port)
    }
}

/// Runs `java "$@"` and kills it (SIGKILL) once its own standard input ends, that is once the
/// test process closed the pipe or died, then removes `$KAFKA_DIR`; exits as the JVM did. A
/// JVM that exits by itself leaves the directory, with the log that says why. (An
/// asynchronous list's standard input is /dev/null in a script: the pipe goes as fd 3.)
const WATCHDOG: &str = r#"exec 3<&0
java "$@" </dev/null 3<&- &
pid=$!
{ read -r _ <&3; kill -9 "$pid" 2>/dev/null; } &
wait "$pid"
code=$?
[ "$code" = 137 ] && rm -rf "$KAFKA_DIR"
exit "$code""#;

/// Starts `kafka.Kafka` on the formatted `dir` under the [`WATCHDOG`]: the child and the
/// pipe that keeps it alive.
fn serve(dir: &Path) -> (Child, Option<ChildStdin>) {
    // Native libraries the JVM unpacks (lz4, zstd, snappy) go to the node's directory,
    // which the watchdog removes: a killed JVM cannot delete them from /tmp itself.
    let mut server = Command::new("sh");
    server
        .args(["-c", WATCHDOG, "sh", "-Xmx512m", "-XX:-UsePerfData"])
        .arg(format!("-Djava.io.tmpdir={}", dir.join("tmp").display()));
    java(&mut server, &jars(), &dir.join("kafka.log"));
    let mut child = server
        .arg("kafka.Kafka")
        .arg(dir.join("server.properties"))
        .env("KAFKA_DIR", dir)
        .stdin(Stdio::piped())
        .spawn()
        .expect("sh runs");
    let lifeline = child.stdin.take();
    (child, lifeline)
}

/// The node [`Kafka::shared`] hands out.
static SHARED: OnceLock<Kafka> = OnceLock::new();

/// The directory holding Apache Kafka's jars: `kafka/jars` under `$CARGO_TARGET_DIR`, else
/// under this crate's `target/`. Panics naming the command that fills it when it holds no
/// broker.
pub fn jars() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| manifest.join("target"), |t| manifest.join(t));
    let dir = target.join("kafka/jars");
    let has_broker = std::fs::read_dir(&dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("kafka_2.13-"))
    });
    assert!(
        has_broker,
        "Apache Kafka's jars are not in {dir}: run scripts/test, or\n  mvn -q -f {manifest}/tests/kafka/pom.xml \
         dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory={dir}",
        dir = dir.display(),
        manifest = manifest.display(),
    );
    dir
}

/// `program … -cp 'JARS/*'` with stdout and stderr appended to `log`.
fn java(program: &mut Command, jars: &Path, log: &Path) {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    program
        .arg("-cp")
        .arg(format!("{}/*", jars.display()))
        .stdout(out.try_clone().unwrap())
        .stderr(out);
}

/// The node's settings: one KRaft voter that is also the only broker, so every internal
/// topic has one replica (the defaults of 3 leave consumer groups and transactions without a
/// coordinator), and the waits meant for bigger clusters are off.
fn server_properties(
    dir: &Path,
    port: u16,
    controller_port: u16,
    secured: Option<&Secured>,
) -> String {
    let (mut listeners, mut advertised) = (
        format!("PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"),
        format!("PLAINTEXT://127.0.0.1:{port}"),
    );
    let mut security = String::new();
    if let Some(s) = secured {
        for (name, port) in [
            ("SASL_PLAINTEXT", s.sasl_port),
            ("SSL", s.ssl_port),
            ("SASL_SSL", s.sasl_ssl_port),
        ] {
            listeners += &format!(",{name}://127.0.0.1:{port}");
            advertised += &format!(",{name}://127.0.0.1:{port}");
        }
        security = secured_properties(dir);
    }
    format!(
        "process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners={listeners}
advertised.listeners={advertised}
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,\\
SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs={data}
# Topics are created by the tests or by the sinks' create_topics, as in production: a
# producer writing to a missing topic fails instead of creating it.
auto.create.topics.enable=false
num.partitions=3
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# The cleaner must have at least 1 MiB per thread (exactly 1 MiB is refused); it looks for
# dirty logs every second instead of 15 s, for the compaction test.
log.cleaner.dedupe.buffer.size=2097152
log.cleaner.backoff.ms=1000
{security}",
        data = dir.join("data").display(),
    )
}

/// The SASL and TLS settings of [`KafkaOptions::secured`]: per SASL listener, the enabled
/// mechanisms and one JAAS config per mechanism; one PEM key store (key and certificate in
/// one file, made by [`write_certificates`]) for both TLS listeners.
fn secured_properties(dir: &Path) -> String {
    let (plain_user, plain_password) = PLAIN_USER;
    let mut out = format!(
        "ssl.keystore.type=PEM
ssl.keystore.location={keystore}
ssl.client.auth=none
",
        keystore = dir.join("server.pem").display()
    );
    for listener in ["sasl_plaintext", "sasl_ssl"] {
        out += &format!(
            "listener.name.{listener}.sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-512,OAUTHBEARER
listener.name.{listener}.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \\
required username=\"admin\" password=\"admin-pw\" user_{plain_user}=\"{plain_password}\";
listener.name.{listener}.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.{listener}.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule \\
required unsecuredLoginStringClaim_sub=\"admin\";
"
        );
    }
    out
}

/// Writes a CA (`ca.crt`) and a server certificate signed by it for 127.0.0.1 and localhost
/// into `dir` (`super::loopback`); `server.pem` holds the server's PKCS#8 key and its
/// certificate, Kafka's PEM key store.
fn write_certificates(dir: &Path) {
    super::loopback::write_ca_and_server(dir, "kafka", "IP:127.0.0.1,DNS:localhost");
    super::loopback::run(
        Command::new("openssl")
            .args([
                "pkcs8",
                "-topk8",
                "-nocrypt",
                "-in",
                "server.key",
                "-out",
                "server.pk8",
            ])
            .current_dir(dir),
    );
    let pem = std::fs::read_to_string(dir.join("server.pk8")).unwrap()
        + &std::fs::read_to_string(dir.join("server.crt")).unwrap();
    std::fs::write(dir.join("server.pem"), pem).unwrap();
}

impl Kafka {
    /// The node every test of this process shares, started by the first that asks (tests
    /// keep to topics of their own). One start instead of one per test: a start takes 5–8 s
    /// of the machine's two cores, up to 20 s when they are busy (`docs/src/development.md`).
    pub fn shared() -> &'static Self {
        SHARED.get_or_init(Self::start)
    }

    /// Formats a fresh log directory and starts a node on it; returns once it answers a
    /// metadata request naming itself.
    pub fn start() -> Self {
        Self::start_with(KafkaOptions::default())
    }

    /// A node of its own with the SASL and TLS listeners of [`Secured`] besides PLAINTEXT.
    pub fn secured() -> Self {
        Self::start_with(KafkaOptions { secured: true })
    }

    /// [`Kafka::start`] with options.
    pub fn start_with(options: KafkaOptions) -> Self {
        let begun = Instant::now();
        let jars = jars();
        let dir = tempfile::Builder::new()
            .prefix("kafka-")
            .tempdir()
            .unwrap()
            .keep();
        let (port, controller_port) = (super::loopback::free_port(), super::loopback::free_port());
        let secured = options.secured.then(|| {
            write_certificates(&dir);
            Secured {
                sasl_port: super::loopback::free_port(),
                ssl_port: super::loopback::free_port(),
                sasl_ssl_port: super::loopback::free_port(),
                ca_file: dir.join("ca.crt"),
            }
        });
        let properties = dir.join("server.properties");
        std::fs::write(
            &properties,
            server_properties(&dir, port, controller_port, secured.as_ref()),
        )
        .unwrap();
        std::fs::create_dir(dir.join("tmp")).unwrap();
        let log = dir.join("kafka.log");
        let mut format = Command::new("java");
        java(&mut format, &jars, &log);
        let formatted = format
            .args(["kafka.tools.StorageTool", "format", "-t", CLUSTER_ID, "-c"])
            .arg(&properties)
            .arg("--ignore-formatted")
            .args(secured.iter().flat_map(|_| {
                let (user, password) = SCRAM_USER;
                [
                    "--add-scram".to_owned(),
                    format!("SCRAM-SHA-512=[name={user},password={password}]"),
                ]
            }))
            .stdin(Stdio::null())
            .status()
            .expect("java runs (Java 17 or newer)");
        assert!(
            formatted.success(),
            "kafka-storage format failed: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let (child, lifeline) = serve(&dir);
        let mut kafka = Self {
            child,
            lifeline,
            port,
            dir,
            started_in: Duration::ZERO,
            secured,
        };
        kafka.wait_until_it_answers(begun);
        kafka.started_in = begun.elapsed();
        eprintln!(
            "Apache Kafka on {} answered {:.1} s after the start of its storage format",
            kafka.brokers(),
            kafka.started_in.as_secs_f64()
        );
        kafka
    }

    /// Stops the node (SIGTERM: a controlled shutdown, its data kept), leaves it down for
    /// `down`, and starts it again on the same data and ports; returns once it answers.
    /// Clients see a broker restart (a rolling update of the brokers, a node lost for a while).
    pub fn outage(&mut self, down: Duration) {
        let stopped = Command::new("pkill")
            .args(["-TERM", "-P", &self.child.id().to_string()])
            .status()
            .expect("pkill runs");
        assert!(stopped.success(), "no JVM under the watchdog to stop");
        let exit = self.child.wait().unwrap();
        assert_ne!(
            exit.code(),
            Some(137),
            "the JVM was killed, its data removed"
        );
        drop(self.lifeline.take());
        std::thread::sleep(down);
        let begun = Instant::now();
        (self.child, self.lifeline) = serve(&self.dir);
        self.wait_until_it_answers(begun);
    }

    /// Polls a metadata request until the node names itself as a broker.
    fn wait_until_it_answers(&mut self, begun: Instant) {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .set("log_level", "0")
            .create()
            .unwrap();
        loop {
            if let Ok(m) = client.fetch_metadata(None, Duration::from_millis(500))
                && !m.brokers().is_empty()
            {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("Apache Kafka exited ({status}): {}", self.log());
            }
            assert!(
                begun.elapsed() < START_PATIENCE,
                "Apache Kafka did not answer within {START_PATIENCE:?}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The JVM's process id (a child of the watchdog shell), once it runs.
    pub fn jvm_pid(&self) -> Option<u32> {
        let shell = self.child.id();
        std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children"))
            .ok()?
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .find(|p: &u32| {
                std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "java")
            })
    }

    /// The bootstrap servers, `127.0.0.1:PORT`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Bytes partition `partition` of `topic` holds on disk (its log segments, compressed as
    /// stored).
    #[allow(dead_code)]
    pub fn stored_bytes(&self, topic: &str, partition: i32) -> u64 {
        let dir = self.dir.join("data").join(format!("{topic}-{partition}"));
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// What the node logged so far (its format and server output).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("kafka.log")).unwrap_or_default()
    }

    /// Creates a topic of `partitions` partitions (one replica) through the admin API, and
    /// returns once every partition has a leader.
    pub fn create_topic(&self, name: &str, partitions: u32) {
        self.create_topic_with(name, partitions, &[]);
    }

    /// [`Kafka::create_topic`] with topic configs (`cleanup.policy`, `segment.ms`, …).
    pub fn create_topic_with(&self, name: &str, partitions: u32, configs: &[(&str, &str)]) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .unwrap();
        let mut topic = NewTopic::new(name, partitions as i32, TopicReplication::Fixed(1));
        for (k, v) in configs {
            topic = topic.set(k, v);
        }
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = futures::executor::block_on(admin.create_topics([&topic], &options))
            .unwrap_or_else(|e| panic!("create topic {name}: {e}"));
        for result in results {
            if let Err((topic, code)) = result {
                panic!("create topic {topic}: {code}");
            }
        }
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = consumer
                .fetch_metadata(Some(name), Duration::from_secs(5))
                .is_ok_and(|m| {
                    m.topics().iter().any(|t| {
                        t.error().is_none()
                            && t.partitions().len() == partitions as usize
                            && t.partitions().iter().all(|p| p.leader() >= 0)
                    })
                });
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "topic {name} has no leaders after 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        // The watchdog kills the JVM and removes the directory when its input ends.
        drop(self.lifeline.take());
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
    /// The record a consumer read, as the crate's reader takes it.
    pub fn of(m: &rdkafka::message::BorrowedMessage<'_>) -> Self {
        let r = kube_event_bridge::sinks::kafka::reader::Record::from(m);
        Self {
            partition: r.partition,
            offset: r.offset,
            key: String::from_utf8_lossy(&r.key).into_owned(),
            value: r.value,
            headers: r.headers,
        }
    }

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
/// partitions' watermarks say (not for a compacted topic, whose offsets have gaps).
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
            out.push(Record::of(&result.expect("consume")));
        }
    }
    out
}

/// Every record of `topic` from its first offset to its end, as a consumer with
/// `isolation.level` `read_committed` (`committed`: what transactions committed, and every
/// non-transactional record) or `read_uncommitted` (aborted and open transactions' records
/// too) reads it. The end: every partition reported its end (`PartitionEOF`, at the last
/// stable offset for `read_committed`) once: what the topic held then (records that arrive
/// later may or may not be in).
pub fn read_topic(brokers: &str, topic: &str, committed: bool) -> Vec<Record> {
    let isolation = if committed {
        "read_committed"
    } else {
        "read_uncommitted"
    };
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "test-reader")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", isolation)
        .create()
        .unwrap();
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let partitions: Vec<i32> = metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| p.id())
        .collect();
    let mut assignment = rdkafka::TopicPartitionList::new();
    for p in &partitions {
        assignment
            .add_partition_offset(topic, *p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let mut at_end = std::collections::HashSet::new();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while at_end.len() < partitions.len() {
        assert!(Instant::now() < deadline, "reading {topic} did not end");
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            Some(Ok(m)) => out.push(Record::of(&m)),
        }
    }
    out
}
