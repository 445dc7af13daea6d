//! What the servers tests start on loopback need: free ports, and certificates made with the
//! `openssl` command (EC keys: fast), a CA and a server certificate signed by it, for the real
//! API server (tests/support/cluster.rs) and the secured Kafka node (tests/support/kafka.rs);
//! and a TCP proxy that counts the bytes a server sends.
//!
//! Benches include this file with `#[path]` beside kafka.rs: it uses nothing of the `support`
//! module around it.
#![allow(dead_code)] // each test binary and bench uses a different part

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free loopback port (bound and released: the process that takes it binds it again),
/// below the kernel's ephemeral range. A port of that range (what binding port 0 gives) can be
/// taken by any outgoing connection of a concurrent test before the server binds it: a Kafka
/// node once failed to start so ("Address already in use").
pub fn free_port() -> u16 {
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_from);
    if high < low + 1000 {
        // An ephemeral range reaching this low: any port will do.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
    }
    loop {
        use std::hash::{BuildHasher, Hasher};
        let mut random = std::collections::hash_map::RandomState::new().build_hasher();
        random.write_u64(PICKS.fetch_add(1, Ordering::Relaxed));
        let port = low + (random.finish() % u64::from(high - low)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

static PICKS: AtomicU64 = AtomicU64::new(0);

/// Runs `cmd` and panics with its standard error when it fails.
pub fn run(cmd: &mut Command) {
    let out = cmd.output().expect("the command runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes into `dir` a CA (`ca.crt`, `ca.key`, common name `{name}-ca`) and a server
/// certificate signed by it (`server.crt`, `server.key`, common name `name`) for
/// `subject_alt_names` (`IP:127.0.0.1,DNS:localhost`).
pub fn write_ca_and_server(dir: &Path, name: &str, subject_alt_names: &str) {
    let ossl = |args: &[&str]| run(Command::new("openssl").args(args).current_dir(dir));
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let (ca_subject, subject) = (format!("/CN={name}-ca"), format!("/CN={name}"));
    ossl(
        &[
            &["req", "-x509", "-nodes", "-days", "30"][..],
            &ec,
            &["-keyout", "ca.key", "-out", "ca.crt", "-subj", &ca_subject],
            &["-addext", "basicConstraints=critical,CA:TRUE"],
            &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ]
        .concat(),
    );
    ossl(
        &[
            &["req", "-nodes"][..],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                &subject,
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("server.ext"),
        format!(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\nsubjectAltName={subject_alt_names}\n"
        ),
    )
    .unwrap();
    ossl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "30",
        "-out",
        "server.crt",
        "-extfile",
        "server.ext",
    ]);
}

/// A loopback TCP proxy in front of the API server that counts the bytes it sends back.
pub struct CountingProxy {
    /// Where it listens, on 127.0.0.1.
    pub port: u16,
    read: Arc<AtomicU64>,
}

impl CountingProxy {
    /// Starts it in front of `127.0.0.1:upstream` (on the current tokio runtime).
    pub async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let read = Arc::new(AtomicU64::new(0));
        let counter = read.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                        let _ = sw.shutdown().await;
                    });
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = sr.read(&mut buf).await {
                        if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    up.abort();
                });
            }
        });
        Self { port, read }
    }

    /// Bytes sent back to its clients so far.
    pub fn bytes(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }
}

/// A copy of `kubeconfig` whose server is the proxy (the certificate names 127.0.0.1, any
/// port).
pub fn proxied_kubeconfig(kubeconfig: &Path, upstream: u16, proxy: u16, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    let from = format!("127.0.0.1:{upstream}");
    assert!(text.contains(&from), "{text}");
    let path = dir.join("proxied.kubeconfig");
    std::fs::write(&path, text.replace(&from, &format!("127.0.0.1:{proxy}"))).unwrap();
    path
}
