//! The `kube-event-bridge` binary: config errors (exit 2, field named), an unreachable cluster
//! (exit 1, target named), and a real run against the test API server ended by SIGTERM.

mod support;

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
};

use support::{
    ApiServer,
    objects::{configmap, typed},
    wait::PATIENCE,
};

const BIN: &str = env!("CARGO_BIN_EXE_kube-event-bridge");

fn check_config(yaml: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const GOOD: &str = "resources:\n  - {api_version: v1, kind: ConfigMap}\nsinks:\n  - {name: out, type: stdout}\nroutes:\n  - {resource: configmap, sinks: [out]}\n";

#[test]
fn shipped_default_config_is_valid() {
    let out = Command::new(BIN)
        .args(["check-config", "config/default.yaml"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let effective: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        effective["kubernetes"]["page_size"], 5000,
        "defaults are filled in"
    );
}

#[test]
fn each_kind_of_bad_config_exits_2_naming_the_field() {
    let cases = [
        (
            GOOD.replace("kind: ConfigMap", "kind: ConfigMap, namespacs: [a]"),
            "resources[0].namespacs: unknown field",
        ),
        (
            GOOD.replace(", kind: ConfigMap", ""),
            "resources[0].kind: missing field",
        ),
        (
            GOOD.replace("type: stdout", "type: carrier-pigeon"),
            "sinks[0].type: unknown variant `carrier-pigeon`",
        ),
        (
            GOOD.replace("sinks: [out]", "sinks: [elsewhere]"),
            "routes[0].sinks[0]: no sink is named \"elsewhere\"",
        ),
        (
            GOOD.replace("resource: configmap", "resource: pods"),
            "routes[0].resource: no resource is named \"pods\"",
        ),
        (
            format!("{GOOD}kubernetes: {{page_size: many}}\n"),
            "kubernetes.page_size: invalid type",
        ),
        (
            format!("{GOOD}shutdown: {{grace_period: soon}}\n"),
            "shutdown.grace_period:",
        ),
        (
            format!("{GOOD}admin: {{address: nowhere}}\n"),
            "admin.address: invalid socket address",
        ),
        (
            GOOD.replace("v1, kind", "v1, resync_period: 10ms, kind"),
            "resources[0].resync_period: must be 0 (off) or at least 1s",
        ),
        ("resources: [\n".to_string(), "cannot load config"),
        (
            GOOD.replace("v1, kind", "v1, filter: 'object.metadata.name ==', kind"),
            "resources[0].filter: syntax error at line 1, column 24",
        ),
        (
            GOOD.replace("v1, kind", "v1, filter: 'obj.metadata.name == \"a\"', kind"),
            "resources[0].filter: unknown name `obj` at line 1, column 1",
        ),
        (
            GOOD.replace("v1, kind", "v1, filter: 'object.metadata.name', kind"),
            "resources[0].filter: the expression must be a boolean",
        ),
        (
            GOOD.replace("v1, kind", "v1, filter_error: ignore, kind"),
            "resources[0].filter_error: unknown variant `ignore`",
        ),
        (
            GOOD.replace("v1, kind", "v1, ignore_fields: [status], kind"),
            "resources[0].ignore_fields[0]: \"status\" is not a JSON pointer",
        ),
        (
            format!("{GOOD}message: {{diff: merge}}\n"),
            "message.diff: unknown variant `merge`",
        ),
    ];
    for (yaml, expected) in cases {
        let (code, stderr) = check_config(&yaml);
        assert_eq!(code, 2, "{expected}: {stderr}");
        assert!(
            stderr.contains(expected),
            "expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn the_shipped_filters_example_is_valid() {
    let out = Command::new(BIN)
        .args(["check-config", "config/filters.yaml"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let effective: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(effective["message"]["diff"], "patch");
    assert_eq!(effective["resources"][0]["filter_error"], "drop");
}

#[test]
fn run_with_a_bad_filter_exits_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(
        &path,
        GOOD.replace("v1, kind", "v1, filter: 'type ==', kind"),
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("resources[0].filter: syntax error at line 1, column 8"),
        "{stderr}"
    );
}

#[test]
fn run_with_a_bad_config_exits_2_and_starts_nothing() {
    let out = Command::new(BIN)
        .args(["run", "--config", "/nonexistent/config.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/config.yaml"));
}

#[test]
fn an_unreachable_cluster_is_reported_with_kubeconfig_context_and_server() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: gone\n  cluster:\n    server: http://127.0.0.1:9\n\
         contexts:\n- name: gone-ctx\n  context:\n    cluster: gone\n    user: u\ncurrent-context: gone-ctx\n\
         users:\n- name: u\n  user:\n    token: t\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["run", "--config", "config/default.yaml"])
        .env("KUBECONFIG", &kubeconfig)
        .env("KEB_ADMIN__ADDRESS", "127.0.0.1:0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for needle in [
        "cannot reach the Kubernetes API server http://127.0.0.1:9/",
        kubeconfig.to_str().unwrap(),
        "context: gone-ctx",
    ] {
        assert!(stderr.contains(needle), "expected {needle:?} in:\n{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_streams_cloudevents_to_stdout_and_stops_cleanly_on_sigterm() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = server.write_kubeconfig(dir.path());
    let mut child = Command::new(BIN)
        .args(["run", "--config", "config/default.yaml"])
        .env("KUBECONFIG", &kubeconfig)
        .env("KEB_ADMIN__ADDRESS", "127.0.0.1:0")
        .env("KEB_LOG__FORMAT", "json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let next = async |rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>| -> serde_json::Value {
        let line = tokio::time::timeout(PATIENCE, rx.recv())
            .await
            .expect("a line in time")
            .expect("stdout open");
        let event = serde_json::from_str(&line).expect("stdout holds only JSON lines");
        support::schema::check_cloudevent(&event);
        event
    };
    let added = next(&mut rx).await;
    assert_eq!(added["specversion"], "1.0");
    assert_eq!(added["type"], "io.github.kube-event-bridge.object.added");
    assert_eq!(added["subject"], "ns/a");
    assert_eq!(added["k8sinitial"], true);
    server.update(typed(&configmap("ns", "a", "2")));
    let updated = next(&mut rx).await;
    assert_eq!(
        updated["type"],
        "io.github.kube-event-bridge.object.updated"
    );
    assert_eq!(updated["data"]["oldObject"]["data"]["v"], "1");
    assert_eq!(updated["data"]["object"]["data"]["v"], "2");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("SIGTERM received") && stderr.contains("Stopped"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("not-a-secret"),
        "credentials never reach the logs"
    );
    assert!(Path::new(&kubeconfig).exists());
}

#[test]
fn shards_shows_where_namespaces_fall_and_the_balance() {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
        .args([
            "shards",
            "--shards",
            "4",
            "payments-prod",
            "ns-01",
            "ns-02",
            "ns-03",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // Names that differ only at the end share a shard: FNV-1a's high bits hardly move.
    let line = text.lines().find(|l| l.contains("ns-01")).expect("listed");
    assert!(line.contains("ns-02") && line.contains("ns-03"), "{text}");
    assert!(text.contains("4 namespaces in 2 of 4 shards"), "{text}");
    let bad = Command::new(env!("CARGO_BIN_EXE_kube-event-bridge"))
        .args(["shards", "--shards", "0", "a"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// Runs the default config until its first published line and its "Started" log line (a
/// fast first list can publish before startup is logged), standard error to a file, with
/// `KEB_LOG__FORMAT=format` when given; returns the log.
async fn log_of_a_short_run(format: Option<&str>) -> String {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = server.write_kubeconfig(dir.path());
    let log = dir.path().join("bridge.log");
    let mut command = Command::new(BIN);
    command
        .args(["run", "--config", "config/default.yaml"])
        .env("KUBECONFIG", &kubeconfig)
        .env("KEB_ADMIN__ADDRESS", "127.0.0.1:0")
        .env_remove("KEB_LOG__FORMAT")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    if let Some(format) = format {
        command.env("KEB_LOG__FORMAT", format);
    }
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let first = tokio::task::spawn_blocking(move || BufReader::new(stdout).lines().next());
    tokio::time::timeout(PATIENCE, first)
        .await
        .expect("a published line in time")
        .unwrap();
    support::wait::until("the Started log line", PATIENCE, async || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("Started"))
    })
    .await;
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    std::fs::read_to_string(&log).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_written_to_a_file_or_pipe_has_no_colour_escapes() {
    let text = log_of_a_short_run(Some("pretty")).await;
    assert!(text.contains("Started"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes in a log file:\n{text}"
    );
}

/// With the defaults (`log.format: auto`), a log that is not a terminal is JSON lines, as a
/// pod's log collector expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_log_format_off_a_terminal_is_json_lines() {
    let text = log_of_a_short_run(None).await;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "Started" && l["level"] == "INFO"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "{text}");
}

/// Credentials written in a NATS server URL (`nats://user:password@host`) connect, and never
/// reach the log, an error, or `check-config`'s output: they read `nats://***@host`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_a_nats_url_never_reach_logs_errors_or_check_config() {
    let nats = support::nats::NatsServer::with_config(
        "authorization { user: bridge, password: url-pass-7731 }",
    );
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = server.write_kubeconfig(dir.path());
    let host = nats.url().trim_start_matches("nats://").to_owned();
    let config_with = |password: &str| {
        let path = dir.path().join(format!("{password}.yaml"));
        std::fs::write(
            &path,
            format!(
                "admin: {{address: \"127.0.0.1:0\"}}\nresources:\n  - {{api_version: v1, kind: ConfigMap}}\n\
                 sinks:\n  - name: bus\n    type: nats\n    nats: {{servers: [\"nats://bridge:{password}@{host}\"], mode: core}}\n\
                 routes:\n  - {{resource: configmap, sinks: [bus]}}\n"
            ),
        )
        .unwrap();
        path
    };

    // A URL written where a list belongs: the config error quotes the value, without its
    // credentials.
    let mistyped = dir.path().join("mistyped.yaml");
    std::fs::write(
        &mistyped,
        std::fs::read_to_string(config_with("url-pass-7731"))
            .unwrap()
            .replace(
                "servers: [\"nats://bridge:url-pass-7731@",
                "servers: \"nats://bridge:url-pass-7731@",
            )
            .replace(&format!("{host}\"], mode"), &format!("{host}\", mode")),
    )
    .unwrap();
    let checked = Command::new(BIN)
        .arg("check-config")
        .arg(&mistyped)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{err}");
    assert!(
        err.contains("servers") && err.contains("nats://***@"),
        "{err}"
    );
    assert!(!err.contains("url-pass-7731"), "{err}");

    let good = config_with("url-pass-7731");
    let checked = Command::new(BIN)
        .arg("check-config")
        .arg(&good)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{printed}");
    assert!(printed.contains(&format!("nats://***@{host}")), "{printed}");
    assert!(!printed.contains("url-pass-7731"), "{printed}");

    let log = dir.path().join("bridge.log");
    let mut child = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&good)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let connected = support::wait::within(PATIENCE, async || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("Connected to NATS"))
    })
    .await;
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(connected, "{text}");
    assert!(text.contains(&format!("nats://***@{host}")), "{text}");
    assert!(
        !text.contains("url-pass-7731"),
        "a credential in the log:\n{text}"
    );

    // A wrong password fails the start; the error names the server, not the password.
    let bad = config_with("wrong-pass-4410");
    let out = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&bad)
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("nats://***@{host}")), "{stderr}");
    assert!(!stderr.contains("wrong-pass-4410"), "{stderr}");
    // The start error says its cause once (a cause in a message is not also a `source`).
    assert_eq!(
        stderr.matches("cannot connect to NATS at").count(),
        1,
        "{stderr}"
    );
}
