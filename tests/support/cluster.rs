//! A real Kubernetes control plane on loopback, as controller-runtime's envtest starts one:
//! etcd 3.6 and the upstream kube-apiserver v1.36, both from `tests/realk8s` (a Go module
//! built once by `scripts/test` into `target/realk8s/realk8s`), with a CA and serving
//! certificate, a service-account key pair, a token file with an admin user and RBAC on.
//! Beside it, client-go's own informer ([`ReferenceInformer`]) as the reference stream.
//!
//! There is no kube-controller-manager: a deleted namespace never finishes terminating (tests
//! use fresh namespaces and delete objects), no token controller (tokens come from the
//! TokenRequest API) and no garbage collector.
//!
//! The API server can be stopped (SIGKILL: a graceful stop waits up to 60 s for open
//! watches) and started again alone; etcd keeps the data. etcd is reached directly
//! ([`Cluster::etcd_delete`], [`Cluster::etcd_compact`]) through its JSON gateway, for what
//! only a cluster's storage can do: delete while the API server is down, compact history.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::core::v1::Namespace,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};

use super::objects::named;

/// The admin user's bearer token (`system:masters`).
const ADMIN_TOKEN: &str = "keb-test-admin-token";

/// The multi-call binary `scripts/test` builds from `tests/realk8s`.
pub fn realk8s() -> PathBuf {
    super::built_tool(
        "realk8s/realk8s",
        "scripts/build-realk8s (scripts/test does)",
    )
}

/// Writes a CA, an API server certificate signed by it and a service-account key pair into
/// `dir`.
fn write_certificates(dir: &Path) {
    super::loopback::write_ca_and_server(
        dir,
        "kube-apiserver",
        "IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,DNS:kubernetes.default.svc",
    );
    let ossl =
        |args: &[&str]| super::loopback::run(Command::new("openssl").args(args).current_dir(dir));
    ossl(&["genrsa", "-out", "sa.key", "2048"]);
    ossl(&["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
}

/// How a [`Cluster`] is started.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// `--feature-gates` entries (`ShardedListAndWatch=true`).
    pub feature_gates: Vec<String>,
    /// `--emulated-version` (`1.35`): the same binary behaving as an older release.
    pub emulated_version: Option<String>,
}

/// etcd and kube-apiserver on loopback, stopped when dropped.
pub struct Cluster {
    dir: tempfile::TempDir,
    options: ClusterOptions,
    etcd: Child,
    etcd_port: u16,
    apiserver: Option<Child>,
    port: u16,
    /// How long the last API server start took until `/readyz` answered.
    pub last_start: Duration,
}

impl Cluster {
    /// A cluster with the default options.
    pub async fn start() -> Self {
        Self::start_with(ClusterOptions::default()).await
    }

    /// Starts etcd, then the API server, and waits until the API server is ready.
    pub async fn start_with(options: ClusterOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("keb-cluster")
            .tempdir()
            .unwrap();
        write_certificates(dir.path());
        std::fs::write(
            dir.path().join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n"),
        )
        .unwrap();
        let (etcd_port, peer_port) = (super::loopback::free_port(), super::loopback::free_port());
        let client_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd = Command::new(realk8s())
            .arg("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            // Test data: no fsync, room for scale benches, quiet logs.
            .args(["--unsafe-no-fsync", "--quota-backend-bytes", "8589934592"])
            .args(["--log-level", "warn"])
            .env("REALK8S_EXIT_WITH_PARENT", std::process::id().to_string())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("etcd.log")).unwrap())
            .spawn()
            .expect("etcd starts");
        let mut cluster = Self {
            dir,
            options,
            etcd,
            etcd_port,
            apiserver: None,
            port: super::loopback::free_port(),
            last_start: Duration::ZERO,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster
            .etcd_post("/v3/maintenance/status", json!({}))
            .is_none()
        {
            assert!(
                Instant::now() < deadline,
                "etcd did not answer: {}",
                cluster.log("etcd")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster.kubeconfig_for("admin", ADMIN_TOKEN);
        cluster.start_apiserver().await;
        cluster
    }

    /// The directory holding certificates, kubeconfigs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The log of `etcd` or `kube-apiserver` so far.
    pub fn log(&self, which: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{which}.log"))).unwrap_or_default()
    }

    /// The process ids of etcd and (while it runs) the API server.
    #[allow(dead_code)]
    pub fn pids(&self) -> (u32, Option<u32>) {
        (self.etcd.id(), self.apiserver.as_ref().map(Child::id))
    }

    /// The API server's URL.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The API server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts the API server (again, after [`Cluster::kill_apiserver`]) on the same port and
    /// waits until `/readyz` answers.
    pub async fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "the API server is running");
        let d = self.dir.path();
        let path = |f: &str| d.join(f).to_str().unwrap().to_owned();
        let mut cmd = Command::new(realk8s());
        cmd.arg("kube-apiserver")
            .args([
                "--etcd-servers",
                &format!("http://127.0.0.1:{}", self.etcd_port),
            ])
            .args([
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
            ])
            .args(["--secure-port", &self.port.to_string()])
            .args(["--tls-cert-file", &path("server.crt")])
            .args(["--tls-private-key-file", &path("server.key")])
            .args(["--client-ca-file", &path("ca.crt")])
            .args(["--token-auth-file", &path("tokens.csv")])
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .args(["--service-account-key-file", &path("sa.pub")])
            .args(["--service-account-signing-key-file", &path("sa.key")])
            .args(["--service-cluster-ip-range", "10.0.0.0/24"])
            .args(["--authorization-mode", "RBAC"])
            .args(["--endpoint-reconciler-type", "none"])
            .args(["--disable-admission-plugins", "ServiceAccount"])
            .args(["--allow-privileged=true", "--v", "1"]);
        if !self.options.feature_gates.is_empty() {
            cmd.args(["--feature-gates", &self.options.feature_gates.join(",")]);
        }
        if let Some(v) = &self.options.emulated_version {
            cmd.args(["--emulated-version", v]);
        }
        let started = Instant::now();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("kube-apiserver.log"))
            .unwrap();
        self.apiserver = Some(
            cmd.env("REALK8S_EXIT_WITH_PARENT", std::process::id().to_string())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("kube-apiserver starts"),
        );
        let client = self.client().await;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = client
                .request_text(http::Request::get("/readyz").body(Vec::new()).unwrap())
                .await;
            if ready.is_ok() {
                break;
            }
            if let Some(status) = self.apiserver.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "kube-apiserver exited ({status}): {}",
                    tail(&self.log("kube-apiserver"), 40)
                );
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready in 120 s ({ready:?}): {}",
                tail(&self.log("kube-apiserver"), 40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.last_start = started.elapsed();
    }

    /// Stops the API server with SIGKILL (etcd keeps running and keeps the data).
    pub fn kill_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The admin user's kubeconfig (written once at start: replicas read it while tests
    /// make clients).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// Writes a kubeconfig `{name}.kubeconfig` that authenticates with `token` (whole: a
    /// temporary file renamed into place, so that a reader never sees half of it).
    pub fn kubeconfig_for(&self, name: &str, token: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.kubeconfig"));
        let partial = self.dir.path().join(format!(".{name}.kubeconfig.partial"));
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {
                "server": self.url(),
                "certificate-authority": self.dir.path().join("ca.crt"),
            }}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
            "current-context": "test",
        });
        std::fs::write(&partial, config.to_string()).unwrap();
        std::fs::rename(&partial, &path).unwrap();
        path
    }

    /// A client for the admin user.
    pub async fn client(&self) -> kube::Client {
        client_from(&self.kubeconfig()).await
    }

    /// Creates namespace `name`.
    pub async fn create_namespace(&self, name: &str) {
        Api::<Namespace>::all(self.client().await)
            .create(&PostParams::default(), &named(None, name))
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
    }

    /// Installs (or, when it exists, replaces the versions of) the CRD `{plural}.{group}` of
    /// `kind`, served at `versions` (`(name, served)`; the last one is the storage version),
    /// each with a schema that keeps any field; waits until it is established and its
    /// storage version is served.
    pub async fn install_crd(
        &self,
        group: &str,
        kind: &str,
        plural: &str,
        namespaced: bool,
        versions: &[(&str, bool)],
    ) {
        let api: Api<CustomResourceDefinition> = Api::all(self.client().await);
        let name = format!("{plural}.{group}");
        let storage = versions.last().expect("a version").0;
        let versions: Vec<Value> = versions
            .iter()
            .map(|(v, served)| {
                json!({
                    "name": v, "served": served, "storage": *v == storage,
                    "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": true,
                    }},
                })
            })
            .collect();
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": group,
                "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(),
                          "listKind": format!("{kind}List")},
                "scope": if namespaced { "Namespaced" } else { "Cluster" },
                "versions": versions,
            },
        }))
        .unwrap();
        match api.get_opt(&name).await.unwrap() {
            None => {
                api.create(&PostParams::default(), &crd).await.unwrap();
            }
            Some(mut existing) => {
                existing.spec = crd.spec;
                api.replace(&name, &PostParams::default(), &existing)
                    .await
                    .unwrap();
            }
        }
        // Established, and the storage version answers a list (the handler is installed a
        // moment after the condition).
        let resource = ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(group, storage, kind),
            plural,
        );
        let objects: Api<DynamicObject> = Api::all_with(self.client().await, &resource);
        super::wait::until(
            format!("CRD {name} served at {storage}"),
            super::wait::PATIENCE,
            async || {
                let established = api
                    .get(&name)
                    .await
                    .ok()
                    .and_then(|c| c.status)
                    .is_some_and(|s| {
                        s.conditions
                            .unwrap_or_default()
                            .iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                established && objects.list(&ListParams::default().limit(1)).await.is_ok()
            },
        )
        .await;
    }

    /// Deletes the CRD `{plural}.{group}` (the API server's own finalizer deletes its objects).
    pub async fn delete_crd(&self, group: &str, plural: &str) {
        let api: Api<CustomResourceDefinition> = Api::all(self.client().await);
        api.delete(&format!("{plural}.{group}"), &Default::default())
            .await
            .unwrap();
    }

    /// Creates `obj` (any kind: its `apiVersion` and `kind` name it; `plural` is its
    /// resource) and returns what the server stored.
    pub async fn create(&self, plural: &str, obj: Value) -> DynamicObject {
        let api = self.dynamic(plural, &obj).await;
        let obj: DynamicObject = serde_json::from_value(obj).unwrap();
        api.create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("create {plural} {:?}: {e}", obj.metadata.name))
    }

    /// The dynamic API of `plural` for `obj`'s kind, in its namespace if it has one.
    async fn dynamic(&self, plural: &str, obj: &Value) -> Api<DynamicObject> {
        let (group, version) = match obj["apiVersion"].as_str().unwrap().split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (
                String::new(),
                obj["apiVersion"].as_str().unwrap().to_owned(),
            ),
        };
        let resource = ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(&group, &version, obj["kind"].as_str().unwrap()),
            plural,
        );
        let client = self.client().await;
        match obj["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client, ns, &resource),
            None => Api::all_with(client, &resource),
        }
    }

    /// The live objects of `resource` (in `namespace`, or all), as the stream's consumers
    /// should end with them: key (`namespace/name`, or `name`) → (uid, resourceVersion).
    pub async fn objects(
        &self,
        resource: &ApiResource,
        namespace: Option<&str>,
    ) -> BTreeMap<String, (String, String)> {
        let client = self.client().await;
        let api: Api<DynamicObject> = match namespace {
            Some(ns) => Api::namespaced_with(client, ns, resource),
            None => Api::all_with(client, resource),
        };
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|o| {
                let m = o.metadata;
                let key = match &m.namespace {
                    Some(ns) => format!("{ns}/{}", m.name.unwrap()),
                    None => m.name.unwrap(),
                };
                (key, (m.uid.unwrap(), m.resource_version.unwrap()))
            })
            .collect()
    }

    /// POSTs `body` to etcd's JSON gateway; the answer, or `None` when etcd does not answer.
    fn etcd_post(&self, path: &str, body: Value) -> Option<Value> {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.etcd_port));
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
        // A stalled etcd fails the test instead of hanging the suite.
        s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
        s.set_write_timeout(Some(Duration::from_secs(10))).ok()?;
        let body = body.to_string();
        write!(
            s,
            "POST {path} HTTP/1.0\r\nHost: etcd\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let (head, body) = answer.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.0 200").then_some(())?;
        serde_json::from_str(body).ok()
    }

    /// Deletes an object straight in etcd (`/registry/{resource}/{namespace}/{name}`, as the
    /// API server stores built-in kinds; custom resources are under their group): no watch
    /// event is ever sent for it.
    pub fn etcd_delete(&self, storage_key: &str) {
        use base64::Engine as _;
        let key = base64::engine::general_purpose::STANDARD.encode(storage_key);
        let answer = self
            .etcd_post("/v3/kv/deleterange", json!({"key": key}))
            .expect("etcd deletes");
        assert_eq!(
            answer["deleted"].as_str(),
            Some("1"),
            "etcd deleted {storage_key}: {answer}"
        );
    }

    /// Compacts etcd's history up to its current revision: watches and lists from any
    /// older resourceVersion get 410 Gone.
    pub fn etcd_compact(&self) {
        use base64::Engine as _;
        let key = base64::engine::general_purpose::STANDARD.encode("/");
        let answer = self
            .etcd_post("/v3/kv/range", json!({"key": key, "limit": 1}))
            .expect("etcd answers");
        let revision: i64 = answer["header"]["revision"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        self.etcd_post(
            "/v3/kv/compaction",
            json!({"revision": revision, "physical": true}),
        )
        .expect("etcd compacts");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_apiserver();
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
    }
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubeconfig).unwrap(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// client-go's dynamic shared informer for one resource (`realk8s informer`), printing one
/// JSON line per notification in delivery order to a file: the stream ours is compared
/// with. Stopped when dropped.
pub struct ReferenceInformer {
    child: Child,
    out: PathBuf,
}

impl ReferenceInformer {
    /// Starts it on `kubeconfig` for `group/version/resource` in `namespace` (`None`: all).
    pub fn start(
        kubeconfig: &Path,
        dir: &Path,
        (group, version, resource): (&str, &str, &str),
        namespace: Option<&str>,
    ) -> Self {
        let out = dir.join(format!("client-go-{resource}.jsonl"));
        let mut cmd = Command::new(realk8s());
        cmd.arg("informer")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "--group",
                group,
                "--version",
                version,
                "--resource",
                resource,
            ]);
        if let Some(ns) = namespace {
            cmd.args(["--namespace", ns]);
        }
        let child = cmd
            .env("REALK8S_EXIT_WITH_PARENT", std::process::id().to_string())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(dir.join(format!("client-go-{resource}.log"))).unwrap())
            .spawn()
            .expect("the reference informer starts");
        Self { child, out }
    }

    /// The complete lines it printed so far.
    pub fn lines(&self) -> Vec<Value> {
        super::json_lines(&self.out)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until it printed `synced`.
    pub async fn synced(&self) {
        super::wait::until(
            "client-go's informer synced",
            super::wait::PATIENCE,
            async || self.lines().iter().any(|l| l["type"] == "synced"),
        )
        .await;
    }
}

impl Drop for ReferenceInformer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
