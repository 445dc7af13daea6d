//! What operators rely on, checked against a running instance: the `/metrics` exposition
//! passes `promtool check metrics`; every metric named in a dashboard query or an alert rule
//! is exported, and every family of ours exported (`keb_*`, `workqueue_*`) is on the
//! dashboard or in an alert; every dashboard query parses (`promtool check rules`).

mod support;

use std::{collections::HashSet, path::Path, process::Command};

use kube_event_bridge::app::App;
use serde_json::json;
use support::{
    ApiServer,
    config::ConfigBuilder,
    http_get,
    objects::{configmap, typed},
    wait::{self, PATIENCE},
};

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed (scripts/test installs the Debian package prometheus)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A live scrape of a running instance that has published something.
async fn scrape() -> String {
    let api = ApiServer::start().await;
    api.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let config = ConfigBuilder::new()
        .cluster("default") // the name a config without one gets
        // With a filter, so that the filter families have their series.
        .resource(
            json!({"api_version": "v1", "kind": "ConfigMap", "publish_if": "type != 'synced'"}),
        )
        .stdout("out", &out)
        .route("configmap", &["out"])
        // Sharded, so that the shard families have their series.
        .set(
            "leader_election",
            json!({"enabled": true, "identity": "one", "namespace": "kube-system",
                   "lease_duration": "1s", "renew_deadline": "800ms", "retry_period": "100ms"}),
        )
        .set("sharding", json!({"shards": 2}))
        .build();
    let app = App::build(config, api.client()).await.unwrap();
    let admin = app.admin_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    wait::until("a published line", PATIENCE, async || {
        std::fs::read_to_string(&out).is_ok_and(|s| !s.is_empty())
    })
    .await;
    // The liveness gauges are refreshed every 500 ms.
    let mut body = String::new();
    wait::until("the watch liveness gauge", PATIENCE, async || {
        let (code, b) = http_get(admin, "/metrics").await;
        assert_eq!(code, 200);
        body = b;
        body.contains("keb_informer_last_event_age_seconds{")
    })
    .await;
    stop.send(()).unwrap();
    run.await.unwrap();
    body
}

/// Metric family names in an exposition, from its `# TYPE` lines, with their types.
fn families(exposition: &str) -> Vec<(String, String)> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut parts = l.split_whitespace();
            (
                parts.next().unwrap().to_owned(),
                parts.next().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Every metric name of ours in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| {
            ["keb_", "workqueue_", "process_"]
                .iter()
                .any(|p| t.starts_with(p))
        })
        .map(str::to_owned)
        .collect()
}

fn dashboard_exprs() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let d: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for p in d["panels"].as_array().unwrap() {
                for t in p["targets"].as_array().into_iter().flatten() {
                    out.push((
                        format!("{}: {}", path.display(), p["title"]),
                        t["expr"].as_str().unwrap().to_owned(),
                    ));
                }
            }
        }
    }
    assert!(out.len() > 10, "dashboards have queries");
    out
}

fn alert_exprs() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/alerts");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut alert = String::new();
        for line in text.lines().map(str::trim) {
            if let Some(a) = line.strip_prefix("- alert:") {
                alert = a.trim().to_owned();
            } else if let Some(e) = line.strip_prefix("expr:") {
                out.push((format!("{}: {alert}", path.display()), e.trim().to_owned()));
            }
        }
    }
    assert!(out.len() >= 7, "alert rules were found");
    out
}

/// The families only a Kafka sink with `exactly_once` has series of (the scraped service
/// has none: no broker here), rendered by the service's own registry.
fn exactly_once_families() -> String {
    let metrics = kube_event_bridge::metrics::Metrics::new();
    metrics
        .kafka_transactions
        .with_label_values(&["kafka", "committed"])
        .inc_by(0);
    metrics
        .kafka_producer_fenced
        .with_label_values(&["kafka"])
        .set(0);
    let rendered = metrics.render();
    let mut out = String::new();
    let mut keep = false;
    for line in rendered.lines() {
        if let Some(rest) = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
        {
            keep = rest.starts_with("keb_kafka_transactions_total ")
                || rest.starts_with("keb_kafka_producer_fenced ");
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(out.contains("keb_kafka_transactions_total{"), "{rendered}");
    assert!(out.contains("keb_kafka_producer_fenced{"), "{rendered}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exposition_passes_promtool_and_exports_every_metric_dashboards_and_alerts_use() {
    let exposition = scrape().await + &exactly_once_families();
    let (ok, report) = promtool(&["check", "metrics"], Some(&exposition));
    assert!(ok, "promtool check metrics:\n{report}");

    let exported = families(&exposition);
    let histograms: HashSet<&str> = exported
        .iter()
        .filter(|(_, t)| t == "histogram")
        .map(|(n, _)| n.as_str())
        .collect();
    let names: HashSet<&str> = exported.iter().map(|(n, _)| n.as_str()).collect();
    for family in [
        "workqueue_depth",
        "workqueue_adds_total",
        "workqueue_retries_total",
        "keb_leader",
        "keb_sink_failed_total",
    ] {
        assert!(names.contains(family), "{family} is exported");
    }
    let mut missing = Vec::new();
    for (place, expr) in dashboard_exprs().into_iter().chain(alert_exprs()) {
        for name in metric_names(&expr) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| histograms.contains(b)))
                .unwrap_or(&name);
            if !names.contains(base) {
                missing.push(format!("{place}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "metrics used but not exported:\n{}",
        missing.join("\n")
    );
    // And the other way round: every family of ours is on the dashboard or in an alert.
    let used: HashSet<String> = dashboard_exprs()
        .into_iter()
        .chain(alert_exprs())
        .flat_map(|(_, expr)| metric_names(&expr))
        .map(|name| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|b| histograms.contains(b))
                        .map(str::to_owned)
                })
                .unwrap_or(name)
        })
        .collect();
    let unused: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.starts_with("keb_") || n.starts_with("workqueue_"))
        .filter(|n| !used.contains(*n))
        .collect();
    assert!(
        unused.is_empty(),
        "families exported but on no dashboard panel and in no alert:\n{}",
        unused.join("\n")
    );
}

#[test]
fn every_dashboard_query_and_alert_rule_parses() {
    // Grafana's variables become what Prometheus accepts, then each query a recording rule.
    let mut rules = String::from("groups:\n  - name: dashboard-queries\n    rules:\n");
    for (i, (_, expr)) in dashboard_exprs().into_iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__interval", "1m")
            .replace("$namespace", ".*")
            .replace("$pod", ".*")
            .replace("$sink", ".*")
            .replace("$resource", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard.rules.yml");
    std::fs::write(&file, rules).unwrap();
    let (ok, report) = promtool(&["check", "rules", file.to_str().unwrap()], None);
    assert!(ok, "promtool check rules (dashboard queries):\n{report}");
    let alerts =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/alerts/kube-event-bridge.rules.yml");
    let (ok, report) = promtool(&["check", "rules", alerts.to_str().unwrap()], None);
    assert!(ok, "promtool check rules (alerts):\n{report}");
}

/// The alert rules' unit tests (`deploy/alerts/kube-event-bridge.rules.test.yml`): a silent
/// watch's liveness gauge, growing as the live test below shows it grow, fires
/// `KubeEventBridgeWatchSilent` after its `for`; a quiet kind's does not.
#[test]
fn the_alert_rules_fire_on_the_series_they_are_for() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/alerts/kube-event-bridge.rules.test.yml");
    let (ok, report) = promtool(&["test", "rules", tests.to_str().unwrap()], None);
    assert!(ok, "promtool test rules:\n{report}");
}

/// Every alert links a runbook section of the book (`docs/src/runbooks.md`: what it means,
/// what to check, what to do) that exists.
#[test]
fn every_alert_links_a_runbook_section_that_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules =
        std::fs::read_to_string(root.join("deploy/alerts/kube-event-bridge.rules.yml")).unwrap();
    let runbooks = std::fs::read_to_string(root.join("docs/src/runbooks.md")).unwrap();
    let mut alerts: Vec<(String, Option<String>)> = Vec::new();
    for line in rules.lines().map(str::trim) {
        if let Some(a) = line.strip_prefix("- alert:") {
            alerts.push((a.trim().to_owned(), None));
        } else if let Some(url) = line.strip_prefix("runbook_url:") {
            alerts.last_mut().expect("inside an alert").1 = Some(url.trim().to_owned());
        }
    }
    assert!(alerts.len() >= 10, "alerts found");
    for (alert, url) in alerts {
        let url = url.unwrap_or_else(|| panic!("{alert} has no runbook_url"));
        let anchor = url
            .strip_prefix("docs/src/runbooks.md#")
            .unwrap_or_else(|| panic!("{alert}: {url} is not a section of docs/src/runbooks.md"));
        let heading = format!("## {alert}\n");
        assert_eq!(anchor, alert.to_lowercase(), "{alert}");
        let at = runbooks
            .find(&heading)
            .unwrap_or_else(|| panic!("docs/src/runbooks.md has no section {heading:?}"));
        let section = &runbooks[at..];
        let section = &section[..section[heading.len()..]
            .find("\n#")
            .map_or(section.len(), |e| e + heading.len())];
        for part in ["What it means.", "What to check.", "What to do."] {
            assert!(section.contains(part), "{alert}: no {part:?}");
        }
    }
}

/// Watch liveness: while bookmarks arrive the gauge stays low; once the watch goes silent,
/// `keb_informer_last_event_age_seconds` grows past the threshold (here the 2 s stall
/// timeout) and `/readyz` names the informer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_watch_shows_in_the_liveness_gauge_and_readyz_names_it() {
    use std::time::Duration;
    let api = ApiServer::start().await;
    api.set_bookmark_interval(Some(Duration::from_millis(300)));
    api.create(typed(&configmap("ns", "a", "1")));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.jsonl");
    let config = ConfigBuilder::new()
        .configmaps()
        .stdout("out", &out)
        .route("configmap", &["out"])
        .kubernetes(json!({"watch_stall_timeout": "2s"}))
        .build();
    let app = App::build(config, api.client()).await.unwrap();
    let admin = app.admin_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    let age = async || -> Option<f64> {
        let (_, body) = http_get(admin, "/metrics").await;
        body.lines()
            .find(|l| {
                l.starts_with("keb_informer_last_event_age_seconds{resource=\"v1/configmaps\"}")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    wait::until("the gauge", PATIENCE, async || age().await.is_some()).await;
    // Bookmarks every 300 ms keep it fresh.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fresh = age().await.unwrap();
    assert!(fresh < 1.5, "age {fresh} s while bookmarks arrive");
    // Silent (this test's client has no read timeout, so the watch is not restarted as the
    // binary's client restarts it after kubernetes.watch_stall_timeout).
    api.stall_watches();
    wait::until("the age past the stall timeout", PATIENCE, async || {
        age().await.is_some_and(|a| a > 3.0)
    })
    .await;
    let (code, body) = http_get(admin, "/readyz").await;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("informer v1/configmaps: nothing heard from the API server"),
        "{body}"
    );
    stop.send(()).unwrap();
    run.await.unwrap();
}
