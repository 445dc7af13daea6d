//! Connecting to the Kubernetes API: its settings, the one client every request goes through
//! (with a client-side rate limit that counts requests), and clear connection errors.
//!
//! Connection trouble is reported, not hidden: a failure names the kubeconfig, context and
//! server that were tried.

use std::{path::PathBuf, time::Duration};

use kube::{
    Client,
    config::{KubeConfigOptions, Kubeconfig},
};

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{metrics::Metrics, problems::Section, workqueue::TokenBucket};

/// How long the start-up reachability check waits for the API server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How to reach the Kubernetes API server.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Path of a kubeconfig file; unset means `$KUBECONFIG`, then `~/.kube/config`, then in-cluster.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use; unset means the file's current context.
    #[serde(default)]
    pub context: Option<String>,
    /// Objects per page of a list request at most: 5000, where client-go asks for 500. A
    /// paged list waits one round trip per page, and each page costs the API server CPU
    /// besides its objects (docs/src/performance.md). The first page asks for 500; each later
    /// one for as many objects as about 8 MiB of JSON holds, judged by the largest object of
    /// the page before and at most four times as many as it: 5000 ConfigMaps of 1 KB, 83
    /// Secrets of 100 KB. A page is held whole while it is read and the estimate is no
    /// bound: lower it where large objects follow many small ones.
    #[serde(default = "default_page_size")]
    pub page_size: u32,
    /// Use a streaming watch-list (`sendInitialEvents=true`) for the initial state instead of a
    /// paged list; needs the WatchList feature on the server (on by default from Kubernetes 1.35).
    #[serde(default)]
    pub streaming_list: bool,
    /// Ask for list responses gzipped (`Accept-Encoding: gzip`), as client-go does (a
    /// kubeconfig's `disable-compression: true` turns it off too): 2 MiB instead of 30 for
    /// 50,000 ConfigMaps of 1 KB, for no sync time or CPU measurable beside the API server
    /// (docs/src/performance.md). Watches are never compressed.
    #[serde(default = "default_gzip")]
    pub gzip: bool,
    /// Server-side timeout of each watch request, in seconds (the watcher re-watches after it).
    #[serde(default = "default_watch_timeout")]
    pub watch_timeout_seconds: u32,
    /// Fail the start when a configured kind is not served; otherwise it waits as pending.
    #[serde(default)]
    pub require_all_resources: bool,
    /// How often discovery is asked again whether pending kinds are served now and watched
    /// kinds still are (besides at every CRD change, when CRDs may be watched).
    #[serde(default = "default_discovery_refresh", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub discovery_refresh: Duration,
    /// How long discovery must keep answering that a watched kind is gone (its CRD deleted,
    /// its version no longer served) before its informers stop and what they cache is
    /// deleted; a group whose discovery fails stops nothing.
    #[serde(default = "default_discovery_grace", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub discovery_grace: Duration,
    /// Requests per second to the API server, over every list, watch and discovery request
    /// (client-side rate limit, as client-go's QPS), and as much again for Lease requests
    /// (a bucket of their own); a paged list counts once, its later pages follow at the
    /// server's pace.
    #[serde(default = "default_qps")]
    pub qps: f64,
    /// Requests the rate limit lets through at once.
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// Lists (first lists and relists, paged or streaming) in flight at once over every
    /// informer of the replica; the others wait their turn. A replica that takes many
    /// shards at once, or starts a wide selection, then holds a few lists in memory at a
    /// time rather than all of them. Watches are not counted.
    #[serde(default = "default_max_concurrent_lists")]
    pub max_concurrent_lists: u32,
    /// A watch that delivers neither an event nor a bookmark for this long is restarted from
    /// its last resourceVersion and counted; 0 leaves it to kube's idle timeout (the watch
    /// timeout plus 5 s).
    #[serde(default = "default_watch_stall_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub watch_stall_timeout: Duration,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            context: None,
            page_size: default_page_size(),
            streaming_list: false,
            gzip: default_gzip(),
            watch_timeout_seconds: default_watch_timeout(),
            require_all_resources: false,
            discovery_refresh: default_discovery_refresh(),
            discovery_grace: default_discovery_grace(),
            qps: default_qps(),
            burst: default_burst(),
            max_concurrent_lists: default_max_concurrent_lists(),
            watch_stall_timeout: default_watch_stall_timeout(),
        }
    }
}

impl KubernetesConfig {
    /// Checks what serde cannot: reports into `p` (paths relative to `kubernetes`).
    pub fn validate(&self, p: &mut Section) {
        if self.page_size == 0 {
            p.add("page_size", "must be at least 1");
        }
        if self.watch_timeout_seconds == 0 {
            p.add("watch_timeout_seconds", "must be at least 1");
        }
        if self.discovery_refresh < Duration::from_secs(1) {
            p.add("discovery_refresh", "must be at least 1s");
        }
        if !(self.qps.is_finite() && self.qps > 0.0) {
            p.add("qps", "must be a positive number");
        }
        if self.burst == 0 {
            p.add("burst", "must be at least 1");
        }
        if self.max_concurrent_lists == 0 {
            p.add("max_concurrent_lists", "must be at least 1");
        }
        let stall = self.watch_stall_timeout;
        if !stall.is_zero() && stall < Duration::from_secs(1) {
            p.add("watch_stall_timeout", "must be 0 (off) or at least 1s");
        }
    }
}

// Ten times client-go's ListPager page size (see `KubernetesConfig::page_size`).
fn default_page_size() -> u32 {
    5000
}
fn default_gzip() -> bool {
    true
}
// Below kube-apiserver's 5-10 min range, so that proxies with shorter idle limits don't cut it.
fn default_watch_timeout() -> u32 {
    290
}
fn default_discovery_refresh() -> Duration {
    Duration::from_secs(60)
}
// Longer than an API server's start, during which its discovery is incomplete.
fn default_discovery_grace() -> Duration {
    Duration::from_secs(30)
}
// kubectl's QPS; client-go's 5/10 is too low for dozens of informers listing at start.
fn default_qps() -> f64 {
    50.0
}
// Lets about a hundred informers start their lists at once.
fn default_burst() -> u32 {
    100
}
// Enough for the kinds of a typical selection to list together; a wide selection over many
// shards queues.
fn default_max_concurrent_lists() -> u32 {
    16
}
// The API server sends a bookmark about every minute: two missed, plus some slack.
fn default_watch_stall_timeout() -> Duration {
    Duration::from_secs(150)
}

/// Errors connecting or resolving resources.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kubeconfig could not be read or used.
    #[error("cannot load kubeconfig {path}: {cause}")]
    Kubeconfig {
        /// The file tried.
        path: String,
        /// The cause (in the message, not a `source`: logs would repeat it).
        cause: kube::config::KubeconfigError,
    },
    /// Neither a kubeconfig nor in-cluster configuration was found.
    #[error(
        "no kubeconfig found ($KUBECONFIG unset, ~/.kube/config missing) and not in a cluster: {0}"
    )]
    NoConfig(kube::config::InClusterError),
    /// The client could not be built (bad TLS material, for example).
    #[error("cannot build a Kubernetes client for {server}: {cause}")]
    Client {
        /// The API server URL.
        server: String,
        /// The cause (in the message).
        cause: kube::Error,
    },
    /// The API server did not answer.
    #[error("cannot reach the Kubernetes API server {} (kubeconfig: {}, context: {}): {reason}",
        .target.server, .target.kubeconfig_display(), .target.context.as_deref().unwrap_or("-"))]
    Unreachable {
        /// What was tried.
        target: Target,
        /// Why it failed.
        reason: String,
    },
    /// A configured kind is not served (yet): its API group version or kind is unknown to
    /// discovery. Such a resource waits as pending unless `require_all_resources` is set.
    #[error("resources[{index}] ({api_version} {kind}): {reason}")]
    NotServed {
        /// Position in `resources`.
        index: usize,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
        /// What discovery said.
        reason: String,
    },
    /// A configured kind cannot be watched.
    #[error("resources[{index}] ({api_version} {kind}): {reason}")]
    Resource {
        /// Position in `resources`.
        index: usize,
        /// Its apiVersion.
        api_version: String,
        /// Its kind.
        kind: String,
        /// What is wrong.
        reason: String,
    },
}

/// `Result` with this module's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The resourceVersion of Lease `namespace/name` (the one this replica holds: the
/// service may get it), an etcd revision written by this replica's acquisition or a later
/// renewal, so past every change the last holder published. `None` (logged) when it cannot be
/// read.
pub async fn lease_resource_version(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Option<Arc<str>> {
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(client.clone(), namespace);
    match leases.get_metadata(name).await {
        Ok(lease) => lease
            .metadata
            .resource_version
            .filter(|rv| !rv.is_empty())
            .map(Arc::from),
        Err(err) => {
            tracing::warn!(lease = name, error = %err, "Cannot read the Lease's resourceVersion; deletes of a kind gone report their checkpoint's version");
            None
        }
    }
}

/// The cluster's identity: the uid of its `kube-system` namespace (what checkpoints record, so
/// that a checkpoint of another cluster is never resumed from). An error names what to grant.
pub async fn identity(client: &Client) -> std::result::Result<String, String> {
    let namespaces = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("", "v1", "Namespace"),
        "namespaces",
    );
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(client.clone(), &namespaces);
    match api.get("kube-system").await {
        Ok(ns) => ns
            .metadata
            .uid
            .filter(|u| !u.is_empty())
            .ok_or_else(|| "namespace kube-system has no uid".to_owned()),
        Err(kube::Error::Api(s)) if s.code == 403 => Err(format!(
            "reading namespace kube-system was refused (403: {}); its uid identifies the cluster \
             in checkpoints: grant get on namespaces, resourceNames [kube-system]",
            s.message
        )),
        Err(e) => Err(format!("cannot read namespace kube-system: {e}")),
    }
}

/// Where the client points: for messages and logs.
#[derive(Debug, Clone)]
pub struct Target {
    /// Kubeconfig file, or `None` for in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// Context used.
    pub context: Option<String>,
    /// API server URL.
    pub server: String,
}

impl Target {
    fn kubeconfig_display(&self) -> String {
        self.kubeconfig
            .as_ref()
            .map_or_else(|| "in-cluster".to_owned(), |p| p.display().to_string())
    }
}

/// Finds the kubeconfig: the configured path, else `$KUBECONFIG` (first entry), else
/// `~/.kube/config` when it exists; `None` means in-cluster.
fn kubeconfig_path(cfg: &KubernetesConfig) -> Option<PathBuf> {
    if let Some(p) = &cfg.kubeconfig {
        return Some(p.clone());
    }
    if let Some(env) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
        return std::env::split_paths(&env).next();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)?
        .join(".kube/config");
    home.exists().then_some(home)
}

/// Builds a client (rate-limited as `cfg` says, counted in `metrics`) and checks that the API
/// server answers.
pub async fn connect(cfg: &KubernetesConfig, metrics: &Metrics) -> Result<(Client, Target)> {
    let path = kubeconfig_path(cfg);
    let (config, context) = match &path {
        Some(p) => {
            let kc_err = |cause| Error::Kubeconfig {
                path: p.display().to_string(),
                cause,
            };
            let kubeconfig = Kubeconfig::read_from(p).map_err(kc_err)?;
            let context = cfg
                .context
                .clone()
                .or_else(|| kubeconfig.current_context.clone());
            let options = KubeConfigOptions {
                context: cfg.context.clone(),
                ..Default::default()
            };
            let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(kc_err)?;
            (config, context)
        }
        None => (kube::Config::incluster().map_err(Error::NoConfig)?, None),
    };
    let target = Target {
        kubeconfig: path,
        context,
        server: config.cluster_url.to_string(),
    };
    let client = client(config, cfg, metrics).map_err(|cause| Error::Client {
        server: target.server.clone(),
        cause,
    })?;
    match tokio::time::timeout(CONNECT_TIMEOUT, client.apiserver_version()).await {
        Ok(Ok(_)) => Ok((client, target)),
        Ok(Err(err)) => Err(Error::Unreachable {
            target,
            reason: err.to_string(),
        }),
        Err(_) => Err(Error::Unreachable {
            target,
            reason: format!("no answer within {CONNECT_TIMEOUT:?}"),
        }),
    }
}

/// A client for `config` whose every request (list, watch, discovery, lease), and every retry
/// of one, first takes a token of the `qps`/`burst` bucket of `cfg`, as client-go's rate
/// limiter does, and whose 429 answers are counted with their Retry-After (and retried after
/// it, as kube does by default). Lease requests (leader election, shards, membership) take
/// their tokens from a bucket of their own with the same settings, as a client-go leader
/// elector has its own client: a replica that starts hundreds of lists at once (many shards
/// of a wide selection) still renews its Leases in time. A request dropped while it waits for
/// its token (a list given up on) gives the token back.
///
/// Every read also times out after `watch_stall_timeout` without a byte (0: never): a watch
/// that delivers neither an event nor a bookmark for that long fails and is re-watched (the
/// API server sends a bookmark about every minute; kube's own idle timeout is the watch
/// timeout plus 5 s). The clock restarts at each request sent, not when a pooled connection
/// went idle.
pub fn client(
    mut config: kube::Config,
    cfg: &KubernetesConfig,
    metrics: &Metrics,
) -> Result<Client, kube::Error> {
    if !cfg.watch_stall_timeout.is_zero() {
        config.read_timeout = Some(cfg.watch_stall_timeout);
        config.reset_reader_on_write = true;
    }
    // kube retries 429, 503 and 504 (after Retry-After) deep inside its stack, where nobody
    // sees them; the same retry goes outside the limit here, so that each attempt takes a
    // token and each 429 is counted.
    config.default_retry = false;
    // Lists only: a watch asks for `identity` itself (`list_watch::watch`). A kubeconfig's
    // `disable-compression: true` turns it off too, as for client-go.
    config.disable_compression |= !cfg.gzip;
    let layer = ApiLimitLayer::new(cfg, metrics);
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&layer)
        // Retry needs a service it can clone.
        .with_layer(&tower::buffer::BufferLayer::new(1024))
        .with_layer(&tower::retry::RetryLayer::new(ApiRetryPolicy(
            kube::client::retry::RetryPolicy::server_retry(),
        )))
        .build())
}

/// kube's server-aware retry (429, 503, 504 after Retry-After), except a watch answered 504:
/// that is the API server's "Too large resource version" (its cache is behind the
/// resourceVersion asked, as after etcd was restored from a backup), and only a relist helps,
/// which the informer's list+watch does at once; retrying the same watch would delay it by up
/// to 15 attempts.
#[derive(Clone)]
struct ApiRetryPolicy(kube::client::retry::RetryPolicy);

impl<Res>
    tower::retry::Policy<http::Request<kube::client::Body>, http::Response<Res>, tower::BoxError>
    for ApiRetryPolicy
{
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        req: &mut http::Request<kube::client::Body>,
        result: &mut Result<http::Response<Res>, tower::BoxError>,
    ) -> Option<Self::Future> {
        let is_watch = req
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "watch=true"));
        if is_watch && matches!(result, Ok(r) if r.status() == http::StatusCode::GATEWAY_TIMEOUT) {
            return None;
        }
        self.0.retry(req, result)
    }

    fn clone_request(
        &mut self,
        req: &http::Request<kube::client::Body>,
    ) -> Option<http::Request<kube::client::Body>> {
        <kube::client::retry::RetryPolicy as tower::retry::Policy<
            http::Request<kube::client::Body>,
            http::Response<Res>,
            tower::BoxError,
        >>::clone_request(&mut self.0, req)
    }
}

/// A token taken for a request that has not waited it out yet: dropped with the request, it
/// goes back to the bucket. (Whole, unlike Go's `Reservation.Cancel`, which gives back only
/// what later reservations did not count on: dropping requests from the middle of a long
/// queue lets new ones overlap the waits of those still queued, up to about twice `qps` for
/// as long as that queue lasts; the API server's 429s, counted and retried, bound it.)
struct Refund(Option<Arc<TokenBucket>>);

impl Refund {
    /// The token is spent: nothing goes back.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Refund {
    fn drop(&mut self) {
        if let Some(bucket) = self.0.take() {
            bucket.cancel();
        }
    }
}

/// Whether `req` is about a Lease (leader election, shards, membership).
fn is_lease<B>(req: &http::Request<B>) -> bool {
    req.uri().path().starts_with("/apis/coordination.k8s.io/")
}

/// Whether `req` asks for a later page of a list (a GET with a `continue` token).
fn continues_list<B>(req: &http::Request<B>) -> bool {
    req.method() == http::Method::GET
        && req.uri().query().is_some_and(|q| {
            q.split('&')
                .any(|p| p.strip_prefix("continue=").is_some_and(|v| !v.is_empty()))
        })
}

#[derive(Clone)]
struct ApiMetrics {
    requests: prometheus::IntCounter,
    throttled: prometheus::IntCounter,
    retry_after: prometheus::IntCounter,
    waited: prometheus::Counter,
}

/// See [`client`].
#[derive(Clone)]
pub struct ApiLimitLayer {
    bucket: Arc<TokenBucket>,
    leases: Arc<TokenBucket>,
    metrics: ApiMetrics,
}

impl ApiLimitLayer {
    /// The bucket of `cfg` (`qps`, `burst`), counting into `metrics`.
    fn new(cfg: &KubernetesConfig, metrics: &Metrics) -> Self {
        Self {
            bucket: Arc::new(TokenBucket::new(cfg.qps, cfg.burst)),
            leases: Arc::new(TokenBucket::new(cfg.qps, cfg.burst)),
            metrics: ApiMetrics {
                requests: metrics.api_requests.clone(),
                throttled: metrics.api_throttled.clone(),
                retry_after: metrics.api_retry_after_seconds.clone(),
                waited: metrics.api_client_wait_seconds.clone(),
            },
        }
    }
}

impl<S> tower::Layer<S> for ApiLimitLayer {
    type Service = ApiLimit<S>;

    fn layer(&self, inner: S) -> ApiLimit<S> {
        ApiLimit {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`ApiLimitLayer`].
pub struct ApiLimit<S> {
    inner: S,
    layer: ApiLimitLayer,
}

impl<S, ReqB, B> tower::Service<http::Request<ReqB>> for ApiLimit<S>
where
    S: tower::Service<http::Request<ReqB>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqB>) -> Self::Future {
        // A paged list took its token with its first page; the later pages follow at the
        // pace the server answers them (throttled, a list of 100,000 objects at 500 a page
        // would spend two seconds waiting for tokens at 50 per second).
        let bucket = if is_lease(&req) {
            &self.layer.leases
        } else {
            &self.layer.bucket
        };
        let (wait, mut refund) = if continues_list(&req) {
            (Duration::ZERO, Refund(None))
        } else {
            (bucket.reserve(), Refund(Some(bucket.clone())))
        };
        // The inner future sends the request when first polled, after the wait.
        let sent = self.inner.call(req);
        let m = self.layer.metrics.clone();
        Box::pin(async move {
            if !wait.is_zero() {
                m.waited.inc_by(wait.as_secs_f64());
                tokio::time::sleep(wait).await;
            }
            // Waited out: the token is spent.
            refund.disarm();
            m.requests.inc();
            let response = sent.await?;
            if response.status() == http::StatusCode::TOO_MANY_REQUESTS {
                m.throttled.inc();
                let seconds = response
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                m.retry_after.inc_by(seconds);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::Mutex,
        task::{Context, Poll},
    };

    use tower::Layer;
    use tower::Service;

    use super::*;

    /// Answers every request at once, 429 with Retry-After 3 for odd ones; records when each
    /// request was sent (the future polled).
    #[derive(Clone, Default)]
    struct Server {
        sent: Arc<Mutex<Vec<tokio::time::Instant>>>,
    }

    impl Service<http::Request<u32>> for Server {
        type Response = http::Response<()>;
        type Error = std::convert::Infallible;
        type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<u32>) -> Self::Future {
            let n = *req.body();
            let sent = self.sent.clone();
            Box::pin(async move {
                sent.lock().unwrap().push(tokio::time::Instant::now());
                let mut r = http::Response::builder();
                if n % 2 == 1 {
                    r = r.status(429).header("retry-after", "3");
                }
                Ok(r.body(()).unwrap())
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requests_take_tokens_of_the_bucket_and_429s_are_counted() {
        let metrics = Metrics::new();
        let cfg = KubernetesConfig {
            qps: 10.0,
            burst: 2,
            ..Default::default()
        };
        let layer = ApiLimitLayer::new(&cfg, &metrics);
        let server = Server::default();
        let mut service = layer.layer(server.clone());
        let start = tokio::time::Instant::now();
        let request = |n: u32, uri: &str| http::Request::get(uri).body(n).unwrap();
        let calls: Vec<_> = (0..12)
            .map(|n| service.call(request(n, "/api/v1/configmaps?limit=500")))
            .collect();
        futures::future::join_all(calls).await;
        let mut offsets: Vec<u128> = server
            .sent
            .lock()
            .unwrap()
            .iter()
            .map(|t| t.duration_since(start).as_millis())
            .collect();
        offsets.sort();
        // Two at once (the burst), then one every 100 ms (10 per second).
        let want: Vec<u128> = [0, 0]
            .into_iter()
            .chain((1..=10).map(|i| i * 100))
            .collect();
        assert_eq!(offsets, want);
        assert_eq!(metrics.api_requests.get(), 12);
        assert_eq!(metrics.api_throttled.get(), 6);
        assert_eq!(metrics.api_retry_after_seconds.get(), 18);
        // Waits: 100 + 200 + … + 1000 ms.
        assert!((metrics.api_client_wait_seconds.get() - 5.5).abs() < 1e-6);
    }

    #[tokio::test(start_paused = true)]
    async fn leases_have_a_bucket_of_their_own_and_dropped_requests_give_tokens_back() {
        let metrics = Metrics::new();
        let cfg = KubernetesConfig {
            qps: 10.0,
            burst: 1,
            ..Default::default()
        };
        let layer = ApiLimitLayer::new(&cfg, &metrics);
        let server = Server::default();
        let mut service = layer.layer(server.clone());
        let start = tokio::time::Instant::now();
        let request = |uri: &str| http::Request::get(uri).body(0).unwrap();
        // Fifty lists queue behind the bucket (5 s of tokens) …
        let lists: Vec<_> = (0..50)
            .map(|_| service.call(request("/api/v1/configmaps?limit=500")))
            .collect();
        // … and a lease renewal goes at once.
        let lease = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/kube-event-bridge";
        service.call(request(lease)).await.unwrap();
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The lists are given up on (a term ended): their tokens come back, and the next list
        // waits for one token, not behind fifty.
        drop(lists);
        tokio::time::advance(Duration::from_millis(100)).await;
        let begun = tokio::time::Instant::now();
        service
            .call(request("/api/v1/configmaps?limit=500"))
            .await
            .unwrap();
        assert!(
            begun.elapsed() <= Duration::from_millis(100),
            "{:?}",
            begun.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn later_pages_of_a_list_take_no_token() {
        let metrics = Metrics::new();
        let cfg = KubernetesConfig {
            qps: 10.0,
            burst: 1,
            ..Default::default()
        };
        let layer = ApiLimitLayer::new(&cfg, &metrics);
        let server = Server::default();
        let mut service = layer.layer(server.clone());
        let start = tokio::time::Instant::now();
        let request = |uri: &str| http::Request::get(uri).body(0).unwrap();
        // The first page takes the only token; its later pages go at once; the next list
        // (and an empty token, which starts a list) waits for a token.
        service
            .call(request("/api/v1/configmaps?limit=500"))
            .await
            .unwrap();
        for page in 0..5 {
            let uri = format!("/api/v1/configmaps?limit=500&continue=tok{page}");
            service.call(request(&uri)).await.unwrap();
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        service
            .call(request("/api/v1/configmaps?limit=500&continue="))
            .await
            .unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        assert_eq!(metrics.api_requests.get(), 7);
    }
}
