//! The list+watch state machine under the [`Reflector`](super::reflector::Reflector):
//! kube-runtime's `watcher` (same states, same events, same errors, so its backoff applies),
//! with client-go's read semantics where kube-runtime differs:
//!
//! - **Every list is a consistent read.** A paged list starts with `resourceVersion` unset
//!   (a quorum read; later pages follow the first page's snapshot through `continue`), and a
//!   streaming watch-list asks for `sendInitialEvents=true` with `resourceVersion` unset and
//!   `resourceVersionMatch=NotOlderThan`, the consistent form (kube-runtime 5 asks for
//!   `resourceVersion=0`, any cached state, which can go back in time behind what the informer
//!   already saw: a relist compared with the cache would then delete recent objects and move
//!   others back to older states).
//! - **A watch from a resourceVersion the server does not have relists.** 410 Gone (compacted)
//!   and 504 "Too large resource version" (the server is behind the informer: etcd restored
//!   from a backup, or a lagging apiserver) both go back to a consistent list, as client-go's
//!   reflector does (`isLastSyncResourceVersionUnavailable`); kube-runtime keeps re-watching
//!   the same too-large resourceVersion and skips every change below it.
//! - **A relist can be asked for** ([`Relists::request`]): whatever the machine is doing (a
//!   list in progress included) is dropped and a new consistent list starts. A new leader
//!   compares its checkpoints with such a list, not with a cache its watch may lag behind.
//! - **Pages grow to what fits.** client-go's pager asks every page for the same `limit`; here
//!   the first page asks for [`FIRST_PAGE`] objects and each later one for an estimate of what
//!   fits in [`PAGE_BYTES`] (from the largest object of the page before, growing at most
//!   [`GROWTH`]-fold a page), at most `page_size`. The API documents `continue` for identical
//!   parameters; kube-apiserver's continue tokens (etcd's and the watch cache's) hold the
//!   snapshot and the next key, not the limit, so a limit that changes between pages
//!   continues the same list. An aggregated API server whose tokens held the limit would
//!   refuse or restart it, and `page_size: 0` (unpaged) or a fixed small one avoids that.
//!
//! Errors other than these are returned as the stream's items, in the state to retry from;
//! the caller's backoff (`default_backoff`) spaces the retries.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use futures::{Stream, StreamExt};
use kube::{
    Api,
    api::{DynamicObject, ListParams, WatchEvent, WatchParams},
    core::Status,
    runtime::watcher::{Error, Event},
};
use tokio::sync::watch;

use super::{ObjectRef, transform::Transform, watch_events};
use crate::shard::Shard;

/// What the list+watch asks the server for.
#[derive(Debug, Clone, Default)]
pub struct ListWatchConfig {
    /// Objects per page of a paged list at most (0: no limit): the first page asks for 500,
    /// each later one for about what fits in 8 MiB (see the module docs).
    pub page_size: u32,
    /// A streaming watch-list instead of a paged list.
    pub streaming: bool,
    /// Server-side timeout of each watch request, in seconds.
    pub timeout: u32,
    /// Label selector.
    pub labels: Option<String>,
    /// Field selector.
    pub fields: Option<String>,
    /// Only this shard's objects (see [`ShardFilter`]).
    pub shard: Option<ShardFilter>,
    /// When the API server was last heard from.
    pub activity: Activity,
    /// Notified each time a watch request is accepted: a watch resumed after a failed start
    /// yields no event until something changes, yet what failed (a 403, say) is over.
    pub opened: Arc<tokio::sync::Notify>,
    /// What every object is rewritten with before it is handed on.
    pub transform: Transform,
    /// Permits for lists in flight, shared by the informers of a factory: a list takes one
    /// before its first request and holds it until its last object is handed on (or it
    /// fails). `None`: no cap.
    pub lists: Option<Arc<tokio::sync::Semaphore>>,
    /// It can never hold an object: one namespace whose hash is outside its shard. It asks
    /// the server nothing; each list is empty at once, and it stays synced.
    pub idle: bool,
}

/// When the list+watch last heard from the API server: a list page, a watch event or a
/// bookmark (a watch that was merely opened, or failed, does not count). Bookmarks come about
/// every minute on an idle watch, so a kind silent well past that has a watch that stopped
/// delivering.
#[derive(Debug, Clone, Default)]
pub struct Activity(Arc<AtomicU64>);

fn activity_base() -> std::time::Instant {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *BASE.get_or_init(std::time::Instant::now)
}

impl Activity {
    fn touch(&self) {
        let ms = activity_base().elapsed().as_millis() as u64 + 1;
        self.0.store(ms, Ordering::Relaxed);
    }

    /// How long ago the API server was last heard from (`None`: never yet).
    pub fn age(&self) -> Option<std::time::Duration> {
        let at = self.0.load(Ordering::Relaxed);
        (at > 0).then(|| {
            activity_base()
                .elapsed()
                .saturating_sub(std::time::Duration::from_millis(at - 1))
        })
    }
}

/// Lists and watches only one shard's objects: `shardSelector` is sent with every list and
/// watch (KEP-5866), and every object is checked on the client too, so the cache holds the
/// shard's objects only whether or not the server applied the selector. Whether it did is
/// read from each list's `shardInfo` (a server without the `ShardedListAndWatch` gate ignores
/// the parameter and echoes nothing) and kept in `mode`.
#[derive(Debug, Clone)]
pub struct ShardFilter {
    /// The shard.
    pub shard: Shard,
    /// What the last list said: [`ShardMode`] as `u8`.
    pub mode: Arc<std::sync::atomic::AtomicU8>,
    /// 1 while the server applies the selector, 0 while the client filters.
    pub server_side: prometheus::IntGauge,
}

/// Where a shard's objects are selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ShardMode {
    /// No list answered yet.
    Unknown = 0,
    /// The API server applied the selector (its list echoed `shardInfo`): only the shard's
    /// objects cross the network.
    Server = 1,
    /// It did not: every object crosses the network and the client drops the others.
    Client = 2,
}

impl ShardFilter {
    /// A filter for `shard`, its mode unknown until the first list.
    pub fn new(shard: Shard, server_side: prometheus::IntGauge) -> Self {
        server_side.set(0);
        Self {
            shard,
            mode: Arc::default(),
            server_side,
        }
    }

    /// What the last list said.
    pub fn mode(&self) -> ShardMode {
        match self.mode.load(Ordering::SeqCst) {
            1 => ShardMode::Server,
            2 => ShardMode::Client,
            _ => ShardMode::Unknown,
        }
    }

    /// Records what a list said: whether the server applied the selector (it echoed
    /// `shardInfo`); logs a change.
    fn note_mode(&self, server_side: bool) {
        let mode = if server_side {
            ShardMode::Server
        } else {
            ShardMode::Client
        };
        let before = self.mode.swap(mode as u8, Ordering::SeqCst);
        self.server_side.set(server_side as i64);
        if before != mode as u8 {
            log_mode(&self.shard, mode);
        }
    }

    /// Whether an object with `namespace` (none: cluster-scoped) is of this shard.
    fn holds(&self, namespace: Option<&str>) -> bool {
        self.shard.holds_namespace(namespace.unwrap_or(""))
    }

    /// `request` with the shard's `shardSelector` added to its query.
    fn select(&self, mut request: http::Request<Vec<u8>>) -> http::Request<Vec<u8>> {
        let uri = request.uri().to_string();
        let sep = if uri.contains('?') { '&' } else { '?' };
        let selector = percent_encode(&self.shard.selector());
        *request.uri_mut() = format!("{uri}{sep}shardSelector={selector}")
            .parse()
            .expect("a valid URI with a percent-encoded parameter added");
        request
    }
}

fn log_mode(shard: &Shard, mode: ShardMode) {
    match mode {
        ShardMode::Server => tracing::info!(
            %shard,
            "The API server applies the shard selector: only this shard's objects are listed and watched"
        ),
        _ => tracing::warn!(
            %shard,
            "The API server ignored the shard selector (no shardInfo: feature gate ShardedListAndWatch off, or a server before 1.36): every object is listed and watched, and this replica keeps its shard's only"
        ),
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(s.len() * 2);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A list page as the API server sends it, with KEP-5866's `shardInfo`; items unparsed.
#[derive(serde::Deserialize)]
struct ListPageJson<'a> {
    #[serde(default)]
    metadata: ListPageMeta,
    // A null `items` is an empty page.
    #[serde(borrow, default)]
    items: Option<Vec<&'a serde_json::value::RawValue>>,
}

/// A list page, its items in their cached form.
struct ListPage {
    metadata: ListPageMeta,
    items: Vec<ObjectRef>,
    /// How many objects to ask for in the next page (see [`next_limit`]).
    next_limit: u32,
}

/// How many objects the first page of a paged list asks for (at most `page_size`):
/// client-go's page, small enough to hand the first objects on soon and to learn their size
/// before asking for more.
const FIRST_PAGE: u32 = 500;

/// About how many bytes of JSON a later page may hold: its response is held whole while it is
/// decoded, next to the page before it being handed on. An estimate, from the page before.
const PAGE_BYTES: usize = 8 << 20;

/// How many times the limit of the page before a page asks for at most.
const GROWTH: u32 = 4;

/// The limit of a paged list's first page (0: unpaged).
fn first_limit(page_size: u32) -> u32 {
    page_size.min(FIRST_PAGE)
}

/// The limit of the page after one asked with `limit` whose largest object took `largest`
/// bytes of JSON: as many objects of that size as fit in [`PAGE_BYTES`], at most [`GROWTH`]
/// times `limit`, at least 1 and at most `page_size` (0: unpaged). A page with no objects (a
/// selector's) tells no size: the limit stays.
fn next_limit(page_size: u32, limit: u32, largest: Option<usize>) -> u32 {
    if page_size == 0 {
        return 0;
    }
    let Some(largest) = largest else {
        return limit;
    };
    u32::try_from(PAGE_BYTES / largest.max(1))
        .unwrap_or(u32::MAX)
        .min(limit.saturating_mul(GROWTH))
        .clamp(1, page_size)
}

#[derive(Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListPageMeta {
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default, rename = "continue")]
    continue_: Option<String>,
    #[serde(default)]
    shard_info: Option<serde_json::Value>,
}

impl ListWatchConfig {
    /// A consistent list's parameters, `limit` objects at most (0: unpaged).
    fn list_params(&self, continue_token: Option<String>, limit: u32) -> ListParams {
        ListParams {
            label_selector: self.labels.clone(),
            field_selector: self.fields.clone(),
            // Unset: a consistent (quorum) read.
            resource_version: None,
            version_match: None,
            limit: (limit > 0).then_some(limit),
            continue_token,
            ..Default::default()
        }
    }

    fn watch_params(&self, initial_events: bool) -> WatchParams {
        WatchParams {
            label_selector: self.labels.clone(),
            field_selector: self.fields.clone(),
            timeout: Some(self.timeout),
            bookmarks: true,
            // With resourceVersion "" (below): the consistent form of the watch-list.
            send_initial_events: initial_events,
        }
    }
}

/// Relist requests, numbered: the informer asks, the list+watch stream starts a new list
/// and records which requests that list serves.
#[derive(Debug)]
pub struct Relists {
    requests: watch::Sender<u64>,
    // The newest request made before the list in progress (or the last one) was asked for.
    listing_for: Arc<AtomicU64>,
    // The resourceVersion of the list whose `InitDone` was handed on last.
    listed_at: ListedAt,
}

/// The resourceVersion of the last complete list (`None`: an idle list+watch's empty one).
type ListedAt = Arc<std::sync::Mutex<Option<Arc<str>>>>;

impl Default for Relists {
    fn default() -> Self {
        Self {
            requests: watch::Sender::new(0),
            listing_for: Arc::default(),
            listed_at: Arc::default(),
        }
    }
}

impl Relists {
    /// Asks the stream to start a new consistent list now; returns the request's number.
    pub fn request(&self) -> u64 {
        let mut n = 0;
        self.requests.send_modify(|r| {
            *r += 1;
            n = *r;
        });
        n
    }

    /// Every request up to this number is served by the list in progress (or the last one):
    /// it was asked for after them. Read it when the list starts (`Init`).
    pub fn listing_for(&self) -> u64 {
        self.listing_for.load(Ordering::SeqCst)
    }

    /// The resourceVersion of the list the last `InitDone` completed (the version its
    /// objects are at, and those it lacks are gone at); `None` for an idle list+watch's empty
    /// list. Read it at `InitDone`.
    pub fn listed_at(&self) -> Option<Arc<str>> {
        self.listed_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn receiver(&self) -> Requests {
        Requests {
            rx: self.requests.subscribe(),
            listing_for: self.listing_for.clone(),
            listed_at: self.listed_at.clone(),
        }
    }
}

/// A stream's side of [`Relists`].
pub struct Requests {
    rx: watch::Receiver<u64>,
    listing_for: Arc<AtomicU64>,
    listed_at: ListedAt,
}

impl Requests {
    /// A list is about to be asked for: it serves every request made so far.
    fn list_starts(&mut self) {
        let n = *self.rx.borrow_and_update();
        self.listing_for.store(n, Ordering::SeqCst);
    }

    /// A list is complete at `rv` (its `InitDone` is handed on next).
    fn listed(&self, rv: Option<&str>) {
        *self.listed_at.lock().unwrap_or_else(|e| e.into_inner()) = rv.map(Arc::from);
    }
}

type WatchStream = watch_events::Events;

/// A list's place among the lists in flight; `None` without a cap.
type Permit = Option<tokio::sync::OwnedSemaphorePermit>;

/// Waits for a place among the lists in flight.
async fn list_permit(config: &ListWatchConfig) -> Permit {
    match &config.lists {
        // Never closed.
        Some(lists) => lists.clone().acquire_owned().await.ok(),
        None => None,
    }
}

enum State {
    Empty,
    InitPage {
        continue_token: Option<String>,
        objects: VecDeque<ObjectRef>,
        last_rv: Option<String>,
        /// The page after `objects`, fetched and decoded on a task of its own while they are
        /// handed on (dropping the state cancels it).
        next: Option<NextPage>,
        /// Its place among the lists in flight ([`ListWatchConfig::lists`]).
        permit: Permit,
    },
    InitialWatch {
        stream: WatchStream,
        permit: Permit,
    },
    InitListed {
        rv: String,
    },
    Watching {
        rv: String,
        stream: WatchStream,
    },
    /// An idle list+watch ([`ListWatchConfig::idle`]): its empty list is handed on.
    IdleListed,
    /// An idle list+watch, waiting for a relist request.
    Idle,
}

/// How often an idle list+watch counts as heard from (a kind silent for longer than the
/// API server's bookmark period, or than `kubernetes.watch_stall_timeout`, looks stalled).
const IDLE_HEARD: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the server answered that it cannot serve a watch or list from the resourceVersion
/// asked: compacted (410 Gone, `Expired`) or ahead of it (`Too large resource version`).
pub fn is_rv_unavailable(status: &Status) -> bool {
    status.code == 410
        || status.reason == "Expired"
        || status.reason == "Gone"
        || status.message.contains("Too large resource version")
        || status.details.as_ref().is_some_and(|d| {
            d.causes
                .iter()
                .any(|c| c.reason == "ResourceVersionTooLarge")
        })
}

fn unavailable(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if is_rv_unavailable(s))
}

/// The list+watch of `api` as kube-runtime watcher events, objects in their cached form
/// (rewritten by `config.transform`), relisting when `relists` asks. See the module docs.
pub fn list_watch(
    api: Api<DynamicObject>,
    config: ListWatchConfig,
    relists: &Relists,
) -> impl Stream<Item = Result<Event<ObjectRef>, Error>> + Send {
    futures::stream::unfold(
        (State::Empty, api, config, relists.receiver()),
        |(mut state, api, config, mut relists)| async move {
            loop {
                let (event, next) = step(&api, &config, state, &mut relists).await;
                state = next;
                if let Some(event) = event {
                    return Some((event, (state, api, config, relists)));
                }
            }
        },
    )
}

/// A page being fetched.
type NextPage = tokio_util::task::AbortOnDropHandle<kube::Result<ListPage>>;

/// Starts fetching the page at `continue_token` (`limit` objects) on a task of its own.
fn prefetch(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    continue_token: String,
    limit: u32,
) -> NextPage {
    let (api, config) = (api.clone(), config.clone());
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        list_page(&api, &config, Some(continue_token), limit).await
    }))
}

/// One page of a consistent list (with the shard's selector, if any), its items taken from
/// the response's bytes to their cached form without a parsed tree (`Transform::cache`).
async fn list_page(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    continue_token: Option<String>,
    limit: u32,
) -> kube::Result<ListPage> {
    let mut request = kube::core::Request::new(api.resource_url())
        .list(&config.list_params(continue_token, limit))
        .map_err(kube::Error::BuildRequest)?;
    if let Some(filter) = &config.shard {
        request = filter.select(request);
    }
    request.extensions_mut().insert("list");
    let text = api.clone().into_client().request_text(request).await?;
    let page: ListPageJson = serde_json::from_str(&text).map_err(kube::Error::SerdeError)?;
    let mut items = Vec::new();
    let other_shard =
        |namespace: Option<&str>| (config.shard.as_ref()).is_some_and(|f| !f.holds(namespace));
    for (i, item) in page.items.iter().flatten().enumerate() {
        // Out of the shard (the server did not select): not worth caching. One that cannot
        // be peeked at is cached first (the parsed path decides it), then judged.
        if config.shard.is_some()
            && let Some(p) = watch_events::peek(item.get())
            && other_shard(p.namespace.as_deref())
        {
            continue;
        }
        let cached = config.transform.cache(item.get()).map_err(|e| {
            let error = format!("list item {i} of the page: {e}");
            kube::Error::SerdeError(serde::de::Error::custom(error))
        })?;
        if !other_shard(cached.namespace()) {
            items.push(Arc::new(cached));
        }
    }
    // Of every item, those of other shards too.
    let largest = page.items.iter().flatten().map(|i| i.get().len()).max();
    Ok(ListPage {
        metadata: page.metadata,
        items,
        next_limit: next_limit(config.page_size, limit, largest),
    })
}

/// A list of at most one object with the shard's selector, for its `shardInfo`.
async fn probe_page(api: &Api<DynamicObject>, config: &ListWatchConfig) -> kube::Result<ListPage> {
    list_page(api, config, None, 1).await
}

/// A watch from `rv` (with the shard's selector, if any); `initial_events` asks for the
/// streaming list. Its objects come cached (see [`watch_events`]).
async fn watch(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    rv: &str,
    initial_events: bool,
) -> kube::Result<WatchStream> {
    let mut request = kube::core::Request::new(api.resource_url())
        .watch(&config.watch_params(initial_events), rv)
        .map_err(kube::Error::BuildRequest)?;
    if let Some(filter) = &config.shard {
        request = filter.select(request);
    }
    request.extensions_mut().insert("watch");
    // As kube's `request_events` asks: Kubernetes >= 1.37 gzips a compressed watch one
    // member per event, which a decompression layer may not decode.
    request.headers_mut().insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    let body = api.clone().into_client().request_stream(request).await?;
    let shard = config.shard.as_ref().map(|f| f.shard);
    Ok(watch_events::events(body, config.transform.clone(), shard))
}

/// The next event of a watch stream, or `None` when a relist was requested first.
async fn next_or_relist(
    stream: &mut WatchStream,
    relists: &mut Requests,
    activity: &Activity,
) -> Option<Option<kube::Result<WatchEvent<ObjectRef>>>> {
    let event = tokio::select! {
        biased;
        changed = relists.rx.changed() => match changed {
            Ok(()) => return None,
            // The sender is gone (the informer is being dropped): go on watching.
            Err(_) => stream.next().await,
        },
        event = stream.next() => event,
    };
    if matches!(event, Some(Ok(_))) {
        activity.touch();
    }
    Some(event)
}

/// What one step yields (an event to hand on, if any) and the state it leaves.
type Step = (Option<Result<Event<ObjectRef>, Error>>, State);

/// One step of the list+watch: a relist request first, else the state's own step.
async fn step(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    state: State,
    relists: &mut Requests,
) -> Step {
    if relists.rx.has_changed().unwrap_or(false) {
        relists.rx.borrow_and_update();
        return (None, State::Empty);
    }
    match state {
        State::Empty if config.idle => {
            relists.list_starts();
            config.activity.touch();
            if let Some(filter) = &config.shard {
                // Nothing of another shard crosses the network.
                filter.server_side.set(1);
            }
            (Some(Ok(Event::Init)), State::IdleListed)
        }
        State::IdleListed => {
            relists.listed(None);
            (Some(Ok(Event::InitDone)), State::Idle)
        }
        State::Idle => idle(config, relists).await,
        State::Empty if config.streaming => start_streaming_list(api, config, relists).await,
        State::Empty => {
            let permit = list_permit(config).await;
            relists.list_starts();
            let page = State::InitPage {
                continue_token: None,
                objects: VecDeque::new(),
                last_rv: None,
                next: None,
                permit,
            };
            (Some(Ok(Event::Init)), page)
        }
        State::InitPage {
            continue_token,
            mut objects,
            last_rv,
            next,
            permit,
        } => {
            if let Some(object) = objects.pop_front() {
                let page = State::InitPage {
                    continue_token,
                    objects,
                    last_rv,
                    next,
                    permit,
                };
                return (Some(Ok(Event::InitApply(object))), page);
            }
            if continue_token.is_none()
                && let Some(rv) = last_rv
            {
                relists.listed(Some(&rv));
                return (Some(Ok(Event::InitDone)), State::InitListed { rv });
            }
            next_page(api, config, continue_token, next, permit).await
        }
        State::InitialWatch { stream, permit } => {
            initial_events(config, stream, permit, relists).await
        }
        State::InitListed { rv } => match watch(api, config, &rv, false).await {
            Ok(stream) => {
                config.opened.notify_one();
                (None, State::Watching { rv, stream })
            }
            Err(err) => {
                let next = if unavailable(&err) {
                    State::Empty
                } else {
                    State::InitListed { rv }
                };
                (Some(Err(Error::WatchStartFailed(err))), next)
            }
        },
        State::Watching { rv, stream } => watching(config, rv, stream, relists).await,
    }
}

/// An idle list+watch: counts as heard from every [`IDLE_HEARD`] until a relist is asked for.
async fn idle(config: &ListWatchConfig, relists: &mut Requests) -> Step {
    tokio::select! {
        changed = relists.rx.changed(), if relists.rx.has_changed().is_ok() => {
            if changed.is_ok() {
                relists.rx.borrow_and_update();
                return (None, State::Empty);
            }
        }
        _ = tokio::time::sleep(IDLE_HEARD) => config.activity.touch(),
    }
    (None, State::Idle)
}

/// Starts a streaming list: a watch that sends the initial events first.
async fn start_streaming_list(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    relists: &mut Requests,
) -> Step {
    let permit = list_permit(config).await;
    relists.list_starts();
    if let Some(filter) = &config.shard {
        // A watch-list echoes no `shardInfo`: a list of one object tells whether the
        // server applies the selector (again at each list: API servers change).
        // Best effort: the mode only tells operators, and a service account may watch
        // without listing.
        match probe_page(api, config).await {
            Ok(page) => filter.note_mode(page.metadata.shard_info.is_some()),
            Err(err) => {
                tracing::debug!(shard = %filter.shard, error = %err, "Cannot tell whether the API server applies the shard selector")
            }
        }
    }
    match watch(api, config, "", true).await {
        Ok(stream) => (
            Some(Ok(Event::Init)),
            State::InitialWatch { stream, permit },
        ),
        Err(err) => (Some(Err(Error::WatchStartFailed(err))), State::Empty),
    }
}

/// The next page of a paged list (prefetched as `next` when there is one), whose objects the
/// next steps hand on while the page after it is fetched.
async fn next_page(
    api: &Api<DynamicObject>,
    config: &ListWatchConfig,
    continue_token: Option<String>,
    next: Option<NextPage>,
    permit: Permit,
) -> Step {
    let first = continue_token.is_none();
    let page = match next {
        Some(next) => match next.await {
            Ok(page) => page,
            Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
            // Cancelled (the runtime shuts down): the list starts over, if ever.
            Err(_) => return (None, State::Empty),
        },
        // The first page: a later one is always prefetched.
        None => {
            debug_assert!(first, "a later page is prefetched");
            list_page(api, config, continue_token, first_limit(config.page_size)).await
        }
    };
    let list = match page {
        Ok(list) => list,
        // An expired continue token included: the list starts over.
        Err(err) => return (Some(Err(Error::InitialListFailed(err))), State::Empty),
    };
    config.activity.touch();
    let last_rv = list.metadata.resource_version.filter(|s| !s.is_empty());
    let continue_token = list.metadata.continue_.filter(|s| !s.is_empty());
    if last_rv.is_none() && continue_token.is_none() {
        return (Some(Err(Error::NoResourceVersion)), State::Empty);
    }
    if let Some(filter) = &config.shard
        && first
    {
        filter.note_mode(list.metadata.shard_info.is_some());
    }
    // The next page is fetched and decoded while this one is handed on.
    let next = continue_token
        .clone()
        .map(|token| prefetch(api, config, token, list.next_limit));
    // Out-of-shard items were dropped as the page was decoded.
    let page = State::InitPage {
        continue_token,
        objects: list.items.into(),
        last_rv,
        next,
        permit,
    };
    (None, page)
}

/// One step of a streaming list's initial events, up to the bookmark that ends them.
async fn initial_events(
    config: &ListWatchConfig,
    mut stream: WatchStream,
    permit: Permit,
    relists: &mut Requests,
) -> Step {
    match next_or_relist(&mut stream, relists, &config.activity).await {
        None => (None, State::Empty),
        Some(Some(Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj)))) => (
            Some(Ok(Event::InitApply(obj))),
            State::InitialWatch { stream, permit },
        ),
        // The API server never sends these during the initial events.
        Some(Some(Ok(WatchEvent::Deleted(_)))) => (None, State::InitialWatch { stream, permit }),
        Some(Some(Ok(WatchEvent::Bookmark(bm)))) => {
            if bm
                .metadata
                .annotations
                .contains_key("k8s.io/initial-events-end")
            {
                relists.listed(Some(&bm.metadata.resource_version));
                let rv = bm.metadata.resource_version;
                (Some(Ok(Event::InitDone)), State::Watching { rv, stream })
            } else {
                (None, State::InitialWatch { stream, permit })
            }
        }
        // The initial events are a whole or nothing: any error starts them over.
        Some(Some(Ok(WatchEvent::Error(status)))) => {
            (Some(Err(Error::WatchError(status))), State::Empty)
        }
        Some(Some(Err(err))) => (Some(Err(Error::WatchFailed(err))), State::Empty),
        Some(None) => (None, State::Empty),
    }
}

/// One event of the watch that follows the list, from `rv`.
async fn watching(
    config: &ListWatchConfig,
    rv: String,
    mut stream: WatchStream,
    relists: &mut Requests,
) -> Step {
    match next_or_relist(&mut stream, relists, &config.activity).await {
        None => (None, State::Empty),
        Some(Some(Ok(WatchEvent::Added(obj) | WatchEvent::Modified(obj)))) => {
            let rv = obj.resource_version().map_or(rv, str::to_owned);
            (Some(Ok(Event::Apply(obj))), State::Watching { rv, stream })
        }
        Some(Some(Ok(WatchEvent::Deleted(obj)))) => {
            let rv = obj.resource_version().map_or(rv, str::to_owned);
            (Some(Ok(Event::Delete(obj))), State::Watching { rv, stream })
        }
        // A bookmark, or an event of another shard (see `watch_events`).
        Some(Some(Ok(WatchEvent::Bookmark(bm)))) => {
            let rv = bm.metadata.resource_version;
            (None, State::Watching { rv, stream })
        }
        Some(Some(Ok(WatchEvent::Error(status)))) => {
            let next = if is_rv_unavailable(&status) {
                State::Empty
            } else {
                State::Watching { rv, stream }
            };
            (Some(Err(Error::WatchError(status))), next)
        }
        Some(Some(Err(err))) => (
            Some(Err(Error::WatchFailed(err))),
            State::Watching { rv, stream },
        ),
        // A watch that ends (its timeout) is started again from where it was.
        Some(None) => (None, State::InitListed { rv }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_grow_to_what_fits_and_never_past_the_page_size() {
        // The first page: client-go's 500, or less if asked.
        assert_eq!(first_limit(5000), 500);
        assert_eq!(first_limit(100), 100);
        assert_eq!(first_limit(0), 0, "unpaged stays unpaged");
        // ConfigMaps of about 1.3 KB: four times as many a page, up to the page size.
        assert_eq!(next_limit(5000, 500, Some(1300)), 2000);
        assert_eq!(next_limit(5000, 2000, Some(1300)), 5000);
        // Secrets of 100 KB: as many as fit in 8 MiB.
        assert_eq!(next_limit(5000, 500, Some(100_000)), 83);
        // Objects larger than the budget: one at a time.
        assert_eq!(next_limit(5000, 83, Some(10 << 20)), 1);
        // A page a selector emptied tells no size.
        assert_eq!(next_limit(5000, 700, None), 700);
        assert_eq!(next_limit(0, 0, Some(1300)), 0, "unpaged stays unpaged");
    }
}
