//! What the servers tests start on loopback need: free ports, and certificates made with the
//! `openssl` command (EC keys: fast), a CA and a server certificate signed by it, for the real
//! API server (tests/support/cluster.rs) and the secured Kafka node (tests/support/kafka.rs).
//!
//! Benches include this file with `#[path]` beside kafka.rs: it uses nothing of the `support`
//! module around it.
#![allow(dead_code)] // each test binary and bench uses a different part

use std::{path::Path, process::Command};

/// A free loopback port (bound and released: the process that takes it binds it again).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

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
