//! Informer behaviour against the local Kubernetes API test server, one behaviour per test.

mod support;

use std::{sync::Arc, time::Duration};

use kube_event_bridge::{
    config::EventType,
    informer::{
        InformerKey, ProcessorListener, SharedIndexInformer, SharedInformerFactory,
        factory::WatchOptions,
    },
    metrics::Metrics,
};
use support::{
    ApiServer, Collector, describe, next,
    objects::{configmap, configmaps, typed},
    take,
    wait::{self, PATIENCE},
};
use tokio_util::sync::CancellationToken;

const ALL: &[EventType] = &[
    EventType::Added,
    EventType::Updated,
    EventType::Deleted,
    EventType::Synced,
];

fn key(namespace: Option<&str>) -> InformerKey {
    InformerKey {
        group: String::new(),
        version: "v1".into(),
        plural: "configmaps".into(),
        namespace: namespace.map(Into::into),
        label_selector: None,
        field_selector: None,
        shard: None,
    }
}

/// A factory on `server`'s client (no rate limit) with these watch options.
fn factory_on(
    server: &ApiServer,
    page_size: u32,
    streaming_list: bool,
    max_concurrent_lists: u32,
) -> SharedInformerFactory {
    SharedInformerFactory::new(
        server.client(),
        WatchOptions {
            page_size,
            streaming_list,
            watch_timeout_seconds: 290,
            max_concurrent_lists,
        },
        Arc::new(Metrics::new()),
    )
}

/// A collector and the resync period of the listener that feeds it.
type Probe<'a> = (&'a Arc<Collector>, Option<Duration>);

struct Running {
    informer: Arc<SharedIndexInformer>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// One ConfigMap informer (page size 10) with the given listeners, started.
fn start(server: &ApiServer, probes: &[Probe], streaming_list: bool) -> Running {
    let metrics = Arc::new(Metrics::new());
    // The bridge's own client (its rate limit and retry policy), as the informers run.
    let client = kube_event_bridge::cluster::client(
        kube::Config::new(server.url().parse().unwrap()),
        &Default::default(),
        &metrics,
    )
    .unwrap();
    let factory = SharedInformerFactory::new(
        client,
        WatchOptions {
            page_size: 10,
            streaming_list,
            watch_timeout_seconds: 290,
            max_concurrent_lists: 16,
        },
        metrics.clone(),
    );
    let informer = factory.informer_for(&configmaps(), key(None), None);
    for (i, (collector, resync)) in probes.iter().enumerate() {
        let l = ProcessorListener::new(format!("l{i}"), ALL, *resync, (*collector).clone());
        informer.add_listener(Arc::new(l));
    }
    let cancel = CancellationToken::new();
    factory.start(&cancel);
    Running {
        informer,
        metrics,
        cancel,
    }
}

/// An informer with one listener over ConfigMaps `ns/<name>` (created at v=1), after their
/// initial adds arrived and with its watch open.
async fn watching(server: &ApiServer, names: &[&str]) -> (Arc<Collector>, Running) {
    for name in names {
        server.create(typed(&configmap("ns", name, "1")));
    }
    let l = Collector::new();
    let r = start(server, &[(&l, None)], false);
    take(&l, names.len()).await;
    wait::until("watch", PATIENCE, async || {
        server.counts("/api/v1/configmaps").watches == 1
    })
    .await;
    (l, r)
}

fn relists(r: &Running) -> u64 {
    r.metrics
        .informer_relists
        .with_label_values(&[r.informer.name()])
        .get()
}

#[tokio::test]
async fn initial_paged_list_of_n_objects_gives_n_initial_adds() {
    let server = ApiServer::start().await;
    for i in 0..25 {
        server.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let l = Collector::new();
    let r = start(&server, &[(&l, None)], false);
    let mut got = take(&l, 25).await;
    got.sort();
    let want: Vec<String> = (0..25)
        .map(|i| format!("add ns/cm-{i:02} v=1 initial"))
        .collect();
    assert_eq!(got, want);
    wait::until("has_synced", PATIENCE, async || r.informer.has_synced()).await;
    assert_eq!(r.informer.indexer().len(), 25);
    assert_eq!(
        server.counts("/api/v1/configmaps").lists,
        3,
        "25 objects in pages of 10"
    );
}

#[tokio::test]
async fn updates_carry_old_and_new_and_deletes_carry_the_last_state() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let l = Collector::new();
    let r = start(&server, &[(&l, None)], false);
    assert_eq!(take(&l, 1).await, ["add ns/a v=1 initial"]);
    wait::until("watch", PATIENCE, async || {
        server.counts("/api/v1/configmaps").watches == 1
    })
    .await;
    server.update(typed(&configmap("ns", "a", "2")));
    server.create(typed(&configmap("ns", "b", "1")));
    server.delete("v1", "ConfigMap", "ns", "a");
    assert_eq!(
        take(&l, 3).await,
        ["update ns/a v=1->2", "add ns/b v=1", "delete ns/a v=2"]
    );
    assert!(r.informer.indexer().get("ns/a").is_none());
    assert!(r.informer.indexer().get("ns/b").is_some());
}

#[tokio::test]
async fn a_dropped_watch_loses_nothing_and_does_not_relist() {
    let server = ApiServer::start().await;
    let (l, r) = watching(&server, &["a", "c"]).await;
    // Cut the connection, keep the reflector out while things change, then let it back in.
    server.block_watches(true);
    server.drop_watches();
    server.create(typed(&configmap("ns", "b", "1")));
    server.update(typed(&configmap("ns", "a", "2")));
    server.delete("v1", "ConfigMap", "ns", "c");
    server.block_watches(false);
    assert_eq!(
        take(&l, 3).await,
        ["add ns/b v=1", "update ns/a v=1->2", "delete ns/c v=1"]
    );
    assert_eq!(
        server.counts("/api/v1/configmaps").lists,
        1,
        "re-watch from the last RV, no relist"
    );
    assert_eq!(relists(&r), 0);
}

#[tokio::test]
async fn objects_deleted_while_the_watch_was_gone_come_out_as_final_state_unknown_deletes() {
    let server = ApiServer::start().await;
    let (l, r) = watching(&server, &["a", "b"]).await;
    server.block_watches(true);
    server.drop_watches();
    server.delete("v1", "ConfigMap", "ns", "b");
    server.create(typed(&configmap("ns", "c", "1")));
    server.update(typed(&configmap("ns", "a", "2")));
    server.compact(); // the re-watch from the old RV gets ERROR 410 → relist
    server.block_watches(false);
    let mut got = take(&l, 3).await;
    got.sort();
    assert_eq!(
        got,
        [
            "add ns/c v=1",
            "delete ns/b v=1 final-state-unknown",
            "update ns/a v=1->2"
        ]
    );
    assert_eq!(relists(&r), 1);
    let mut keys = r.informer.indexer().list_keys();
    keys.sort();
    assert_eq!(keys, ["ns/a", "ns/c"]);
}

#[tokio::test]
async fn a_relist_finding_a_new_uid_under_a_key_deletes_the_old_incarnation_then_adds() {
    let server = ApiServer::start().await;
    let (l, r) = watching(&server, &["a"]).await;
    server.block_watches(true);
    server.drop_watches();
    server.delete("v1", "ConfigMap", "ns", "a");
    server.create(typed(&configmap("ns", "a", "2")));
    server.compact();
    server.block_watches(false);
    assert_eq!(
        take(&l, 2).await,
        ["delete ns/a v=1 final-state-unknown", "add ns/a v=2"],
        "client-go reports this as an update; consumers keyed by uid need the delete"
    );
    assert_eq!(relists(&r), 1);
}

#[tokio::test]
async fn after_etcd_is_restored_a_too_large_resource_version_relists_instead_of_rewatching() {
    let server = ApiServer::start().await;
    let (l, r) = watching(&server, &["a", "b"]).await;
    let backup = server.backup();
    server.create(typed(&configmap("ns", "c", "1")));
    server.update(typed(&configmap("ns", "a", "2")));
    take(&l, 2).await;
    // etcd goes back to the backup: the informer's resourceVersion is now ahead of the
    // server's (a watch from it gets 504 "Too large resource version").
    server.restore(&backup);
    server.create(typed(&configmap("ns", "d", "1")));
    let mut got = take(&l, 3).await;
    got.sort();
    assert_eq!(
        got,
        [
            "add ns/d v=1",
            "delete ns/c v=1 final-state-unknown",
            "update ns/a v=2->1"
        ],
        "a consistent relist, then the changes made after the restore (kube-runtime's watcher \
         re-watches the too-large resourceVersion forever and never sees d)"
    );
    assert_eq!(relists(&r), 1);
    let mut keys = r.informer.indexer().list_keys();
    keys.sort();
    assert_eq!(keys, ["ns/a", "ns/b", "ns/d"]);
}

/// A lagging watch cache (reads at resourceVersion "0" served from an older state) is never
/// read: paged and streaming lists are consistent reads, so an informer's first list, and
/// every relist compared with its cache, never goes back in time.
#[tokio::test]
async fn lists_and_watch_lists_are_consistent_reads_that_a_lagging_cache_cannot_send_back_in_time()
{
    for streaming in [false, true] {
        let server = ApiServer::start().await;
        server.create(typed(&configmap("ns", "a", "1")));
        server.create(typed(&configmap("ns", "gone", "1")));
        server.serve_stale_cache(Some(server.backup()));
        server.update(typed(&configmap("ns", "a", "2")));
        server.create(typed(&configmap("ns", "new", "1")));
        server.delete("v1", "ConfigMap", "ns", "gone");
        let l = Collector::new();
        let r = start(&server, &[(&l, None)], streaming);
        let mut got = take(&l, 2).await;
        got.sort();
        assert_eq!(
            got,
            ["add ns/a v=2 initial", "add ns/new v=1 initial"],
            "streaming: {streaming}"
        );
        wait::until("has_synced", PATIENCE, async || r.informer.has_synced()).await;
        // A relist asked for (as a new leader does) is a consistent read too.
        let cancel = CancellationToken::new();
        r.informer.deactivate_listeners();
        server.update(typed(&configmap("ns", "a", "3")));
        let handed = r
            .informer
            .activate_listeners_after_relist(&cancel, |_| true)
            .await
            .expect("relisted");
        assert_eq!(handed, 2);
        let mut got = take(&l, 2).await;
        got.sort();
        assert_eq!(
            got,
            ["add ns/a v=3 initial", "add ns/new v=1 initial"],
            "streaming: {streaming}"
        );
        assert_eq!(relists(&r), 1);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), l.pop())
                .await
                .is_err(),
            "nothing else"
        );
    }
}

/// A new leader's relist streams into the listeners it switches on: each object of the fresh
/// list reaches them once, as an initial add, while later pages are still fetched; nothing
/// of the stale cache, none of the deletes the list infers (a resume deletes what the list
/// lacks from its checkpoint), the changes after the list as to any listener, and the sync
/// once, after the whole list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_streams_into_listeners_switched_on() {
    let server = ApiServer::start().await;
    let names: Vec<String> = (0..30).map(|i| format!("cm-{i:02}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let (l, r) = watching(&server, &refs).await;
    wait::until("synced", PATIENCE, async || l.synced().0 == 1).await;
    // The cache goes stale: the watch is cut and cannot come back while these change, and
    // the listener is off.
    server.block_watches(true);
    server.drop_watches();
    r.informer.deactivate_listeners();
    server.update(typed(&configmap("ns", "cm-00", "2")));
    server.update(typed(&configmap("ns", "cm-29", "2")));
    server.delete("v1", "ConfigMap", "ns", "cm-15");
    server.create(typed(&configmap("ns", "new", "1")));
    // Pages of 10, each answered 300 ms late: the list takes over a second.
    server.delay_lists(Some(Duration::from_millis(300)));
    let cancel = CancellationToken::new();
    let informer = r.informer.clone();
    let activation = tokio::spawn(async move {
        informer
            .activate_listeners_after_relist(&cancel, |_| true)
            .await
    });
    // The watch may open again (a watch request waiting out its 429s holds the relist
    // back): whether it brings these changes before the list or not, they reach the
    // listener only from the list.
    server.block_watches(false);
    let first = next(&l).await;
    assert!(
        !activation.is_finished(),
        "the first object came before the list was whole: {}",
        describe(&first)
    );
    let handed = activation.await.unwrap().expect("relisted");
    assert_eq!(handed, 30);
    let mut got = vec![describe(&first)];
    got.extend(take(&l, 29).await);
    let (synced, before) = l.synced();
    assert_eq!(
        (synced, before),
        (2, 30 + 30),
        "synced once more, after the whole list"
    );
    let mut expected: Vec<String> = names
        .iter()
        .filter(|n| n.as_str() != "cm-15")
        .map(|n| {
            let v = if n == "cm-00" || n == "cm-29" { 2 } else { 1 };
            format!("add ns/{n} v={v} initial")
        })
        .chain(["add ns/new v=1 initial".to_owned()])
        .collect();
    expected.sort();
    got.sort();
    assert_eq!(
        got, expected,
        "each listed object once, at its listed version"
    );
    server.delay_lists(None);
    server.update(typed(&configmap("ns", "cm-01", "2")));
    assert_eq!(take(&l, 1).await, ["update ns/cm-01 v=1->2"]);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), l.pop())
            .await
            .is_err(),
        "nothing else"
    );
    assert_eq!(relists(&r), 1);
}

/// A relist asked for ahead (a term's start) and still running when the listeners are
/// switched on is not asked for again: they get what it popped so far from the cache and the
/// rest as it pops, each object once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_asked_for_ahead_streams_into_listeners_switched_on_while_it_runs() {
    let server = ApiServer::start().await;
    let names: Vec<String> = (0..30).map(|i| format!("cm-{i:02}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let (l, r) = watching(&server, &refs).await;
    wait::until("synced", PATIENCE, async || l.synced().0 == 1).await;
    r.informer.deactivate_listeners();
    // Pages of 10, each answered 300 ms late.
    server.delay_lists(Some(Duration::from_millis(300)));
    let asked = r.informer.request_relist();
    wait::until("the first page listed", PATIENCE, async || {
        r.metrics
            .informer_watch_events
            .with_label_values(&[r.informer.name(), "listed"])
            .get()
            >= 30 + 10
    })
    .await;
    // It pops at once; the next page is 300 ms away.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let handed = r
        .informer
        .activate_listeners_after_relist_since(&CancellationToken::new(), |_| true, Some(asked))
        .await
        .expect("relisted");
    assert_eq!(handed, 30);
    let mut got = take(&l, 30).await;
    got.sort();
    let mut expected: Vec<String> = names
        .iter()
        .map(|n| format!("add ns/{n} v=1 initial"))
        .collect();
    expected.sort();
    assert_eq!(got, expected, "each object once");
    assert_eq!(
        l.synced(),
        (2, 60),
        "synced once more, after the whole list"
    );
    assert_eq!(relists(&r), 1, "the list asked for ahead, not another");
    server.delay_lists(None);
    server.update(typed(&configmap("ns", "cm-00", "2")));
    assert_eq!(take(&l, 1).await, ["update ns/cm-00 v=1->2"]);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), l.pop())
            .await
            .is_err(),
        "nothing else"
    );
}

/// A listener switched on "after a relist" before its informer runs (a sharded replica's
/// informers start with its term) is streamed the informer's first list, and told it is
/// through once, like the listener that was on from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_list_streamed_into_a_listener_syncs_it_once() {
    let server = ApiServer::start().await;
    for i in 0..25 {
        server.create(typed(&configmap("ns", &format!("cm-{i:02}"), "1")));
    }
    let factory = factory_on(&server, 10, false, 16);
    let informer = factory.informer_for(&configmaps(), key(None), None);
    let (on, streamed) = (Collector::new(), Collector::new());
    for (name, c) in [("on", &on), ("streamed", &streamed)] {
        informer.add_listener(Arc::new(ProcessorListener::new(
            name.to_owned(),
            ALL,
            None,
            c.clone(),
        )));
    }
    informer.deactivate_listeners_where(|l| l.name() == "streamed");
    let cancel = CancellationToken::new();
    let activation = tokio::spawn({
        let (informer, cancel) = (informer.clone(), cancel.clone());
        async move {
            informer
                .activate_listeners_after_relist(&cancel, |l| l.name() == "streamed")
                .await
        }
    });
    factory.start(&cancel);
    assert_eq!(activation.await.unwrap(), Some(25));
    for c in [&on, &streamed] {
        let mut got = take(c, 25).await;
        got.sort();
        assert!(got.iter().all(|d| d.ends_with("v=1 initial")), "{got:?}");
        wait::until("synced", PATIENCE, async || c.synced().0 == 1).await;
    }
    // The informer's own signal has had its turns by now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(on.synced(), (1, 25));
    assert_eq!(streamed.synced(), (1, 25));
    cancel.cancel();
}

#[tokio::test]
async fn a_relist_with_unchanged_objects_gives_no_phantom_updates() {
    let server = ApiServer::start().await;
    for name in ["a", "b", "c"] {
        server.create(typed(&configmap("ns", name, "1")));
    }
    let l = Collector::new();
    let r = start(&server, &[(&l, None)], false);
    take(&l, 3).await;
    wait::until("watch", PATIENCE, async || {
        server.counts("/api/v1/configmaps").watches == 1
    })
    .await;
    server.block_watches(true);
    server.drop_watches();
    // A write to another resource moves the (cluster-wide) resourceVersion past the
    // reflector's, so after compaction its re-watch gets 410 and it relists: same objects.
    let mut secret = k8s_openapi::api::core::v1::Secret::default();
    secret.metadata.name = Some("unrelated".into());
    server.create(typed(&secret));
    server.compact();
    server.block_watches(false);
    wait::until("relist", PATIENCE, async || {
        relists(&r) == 1 && server.counts("/api/v1/configmaps").watches >= 3
    })
    .await;
    // The first notification after the relist is the next real change, not a phantom update.
    server.create(typed(&configmap("ns", "z", "1")));
    assert_eq!(take(&l, 1).await, ["add ns/z v=1"]);
    assert!(l.is_empty());
}

#[tokio::test]
async fn resync_notifications_arrive_at_each_listeners_own_period() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    let (fast, slow, none) = (Collector::new(), Collector::new(), Collector::new());
    let probes = [
        (&fast, Some(Duration::from_secs(1))),
        (&slow, Some(Duration::from_secs(3))),
        (&none, None),
    ];
    let _r = start(&server, &probes, false);
    for l in [&fast, &slow, &none] {
        assert_eq!(take(l, 1).await, ["add ns/a v=1 initial"]);
    }
    // Wait for the slow listener's first resync, counting the fast one's meanwhile.
    assert_eq!(describe(&next(&slow).await), "sync ns/a v=1");
    let mut fast_syncs = 0;
    while let Some(n) = fast.try_pop() {
        assert_eq!(describe(&n), "sync ns/a v=1");
        fast_syncs += 1;
    }
    assert!(
        fast_syncs >= 2,
        "1 s listener resynced {fast_syncs} times before the 3 s one resynced once"
    );
    assert!(
        none.is_empty(),
        "a listener without a resync period gets no resyncs"
    );
}

#[tokio::test]
async fn list_429_is_retried_with_backoff() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    server.fail_next_lists(2);
    let l = Collector::new();
    let r = start(&server, &[(&l, None)], false);
    assert_eq!(take(&l, 1).await, ["add ns/a v=1 initial"]);
    // kube-client retries a 429 itself (as client-go's REST client does), so the reflector
    // never sees these errors; the server saw every attempt.
    assert_eq!(server.counts("/api/v1/configmaps").lists, 3);
    wait::until("has_synced", PATIENCE, async || r.informer.has_synced()).await;
}

#[tokio::test]
async fn streaming_watch_list_gives_initial_adds_then_changes_on_the_same_stream() {
    let server = ApiServer::start().await;
    server.create(typed(&configmap("ns", "a", "1")));
    server.create(typed(&configmap("ns", "b", "1")));
    let l = Collector::new();
    let r = start(&server, &[(&l, None)], true);
    let mut got = take(&l, 2).await;
    got.sort();
    assert_eq!(got, ["add ns/a v=1 initial", "add ns/b v=1 initial"]);
    wait::until("has_synced", PATIENCE, async || r.informer.has_synced()).await;
    server.update(typed(&configmap("ns", "b", "2")));
    assert_eq!(take(&l, 1).await, ["update ns/b v=1->2"]);
    let counts = server.counts("/api/v1/configmaps");
    assert_eq!(
        (counts.lists, counts.watches),
        (0, 1),
        "no list request; one watch"
    );
}

#[tokio::test]
async fn factory_hands_out_one_informer_per_key() {
    let server = ApiServer::start().await;
    let factory = factory_on(&server, 500, false, 16);
    let a = factory.informer_for(&configmaps(), key(None), None);
    let b = factory.informer_for(&configmaps(), key(None), None);
    let c = factory.informer_for(&configmaps(), key(Some("ns")), None);
    assert!(Arc::ptr_eq(&a, &b));
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(factory.informers().len(), 2);
    assert_eq!(c.name(), "v1/configmaps@ns");
}

#[tokio::test]
async fn garbage_on_the_watch_is_counted_and_the_watch_recovers_with_the_cache_intact() {
    let server = ApiServer::start().await;
    let (l, r) = watching(&server, &["a", "b"]).await;
    let errors = || {
        r.metrics
            .informer_watch_errors
            .with_label_values(&[r.informer.name()])
            .get()
    };
    assert_eq!(errors(), 0);
    // The watch is open and delivering before anything is injected.
    server.update(typed(&configmap("ns", "b", "2")));
    assert_eq!(take(&l, 1).await, ["update ns/b v=1->2"]);
    let a = serde_json::to_string(&typed(&configmap("ns", "a", "9"))).unwrap();
    // (line, whether kube reports it): kube-client drops a line that ends inside a JSON value
    // without a word (it takes it for the unfinished last line of a closed stream), so a
    // truncated event is skipped, not counted.
    let bad_lines = [
        ("this is not JSON".to_string(), true),
        (
            r#"{"type":"MODIFIED","object":{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a""#
                .to_string(),
            false,
        ),
        (format!(r#"{{"type":"SURPRISE","object":{a}}}"#), true),
        (r#"{"type":"MODIFIED","object":[1,2,3]}"#.to_string(), true),
        (
            r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","code":500,"reason":"InternalError","message":"test"}}"#
                .to_string(),
            true,
        ),
    ];
    for (i, (bad, counted)) in bad_lines.iter().enumerate() {
        let before = errors();
        server.inject_watch_lines(&[bad.as_str()]);
        if *counted {
            wait::until(
                format!("{bad:?} counted as a watch error"),
                PATIENCE,
                async || errors() > before,
            )
            .await;
        }
        // The watch recovers: the next real change arrives, and only it.
        let v = format!("{}", i + 3);
        server.update(typed(&configmap("ns", "b", &v)));
        assert_eq!(
            take(&l, 1).await,
            [format!("update ns/b v={}->{v}", i + 2)],
            "after {bad:?}"
        );
        if !*counted {
            assert_eq!(errors(), before, "{bad:?}");
        }
        // Nothing cached was lost or changed by the garbage.
        assert_eq!(r.informer.indexer().len(), 2);
        let cached_a = r.informer.indexer().get("ns/a").unwrap();
        assert_eq!(cached_a.resource_version(), Some("101"), "after {bad:?}");
        assert!(l.is_empty(), "no phantom notification after {bad:?}");
    }
    assert_eq!(relists(&r), 0, "garbage is not a reason to relist");
}

/// `max_concurrent_lists` caps the lists in flight over every informer of a factory (a
/// replica taking many shards at once lists a few at a time): eight informers, one per
/// namespace, whose lists take two pages each and whose every page the server answers 100 ms
/// late. With a cap of 2 the server never answers more than two list requests at once, and
/// every informer still gets all its objects; with the default 16 more than two list together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_in_flight_are_capped_over_every_informer_of_a_factory() {
    for cap in [2u32, 16] {
        let server = ApiServer::start().await;
        for ns in 0..8 {
            for i in 0..15 {
                server.create(typed(&configmap(
                    &format!("ns-{ns}"),
                    &format!("cm-{i}"),
                    "1",
                )));
            }
        }
        server.delay_lists(Some(Duration::from_millis(100)));
        let factory = factory_on(&server, 10, false, cap);
        let collectors: Vec<Arc<Collector>> = (0..8)
            .map(|ns| {
                let informer =
                    factory.informer_for(&configmaps(), key(Some(&format!("ns-{ns}"))), None);
                let l = Collector::new();
                informer.add_listener(Arc::new(ProcessorListener::new("l", ALL, None, l.clone())));
                l
            })
            .collect();
        let cancel = CancellationToken::new();
        factory.start(&cancel);
        for l in &collectors {
            assert_eq!(take(l, 15).await.len(), 15);
        }
        cancel.cancel();
        let most = server.most_lists_in_flight();
        println!("max_concurrent_lists {cap}: at most {most} list requests answered at once");
        if cap == 2 {
            assert_eq!(most, 2, "the cap was reached, never passed");
        } else {
            assert!(most > 2, "without a low cap the lists overlap ({most})");
        }
    }
}

/// A paged list asks for client-go's 500 objects first, then for as many as about 8 MiB of
/// JSON holds (judged by the largest object of the page before), at most four times as many
/// as the page before and never more than `page_size`; every object arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_grow_to_what_fits_in_about_8_mib() {
    // (objects, bytes of data each, the limits asked)
    let small = (3000, 1, vec![Some(500), Some(2000), Some(5000)]);
    // Objects of about 50 KB: 8 MiB holds some 167 of them.
    let large = (520, 50_000, vec![Some(500), Some(8 * 1024 * 1024 / 50_300)]);
    for (n, bytes, limits) in [small, large] {
        let server = ApiServer::start().await;
        let value = "x".repeat(bytes);
        for i in 0..n {
            server.create(typed(&configmap("ns", &format!("cm-{i:04}"), &value)));
        }
        let factory = factory_on(&server, 5000, false, 16);
        let informer = factory.informer_for(&configmaps(), key(None), None);
        let l = Collector::new();
        informer.add_listener(Arc::new(ProcessorListener::new("l", ALL, None, l.clone())));
        let cancel = CancellationToken::new();
        factory.start(&cancel);
        let mut got = take(&l, n).await;
        got.sort();
        got.dedup();
        assert_eq!(got.len(), n, "every object once");
        wait::until("has_synced", PATIENCE, async || informer.has_synced()).await;
        cancel.cancel();
        let asked = server.list_limits("/api/v1/configmaps");
        println!("{n} objects of {bytes} bytes: limits {asked:?}");
        assert_eq!(asked.len(), limits.len(), "{asked:?}");
        assert_eq!(asked[0], limits[0]);
        for (got, want) in asked.iter().zip(&limits).skip(1) {
            // Within a few objects of the estimate (the object's JSON beside its data).
            let (got, want) = (got.unwrap(), want.unwrap());
            assert!(
                got.abs_diff(want) <= want / 50,
                "limits {asked:?}, about {limits:?}"
            );
        }
    }
}

/// An informer of one namespace for a shard that namespace's hash falls outside of can never
/// hold an object: it asks the server nothing (no list, no watch) and is synced, empty, at
/// once; the informer of the shard that holds the namespace lists its objects.
#[tokio::test]
async fn an_informer_of_a_namespace_outside_its_shard_asks_the_server_nothing() {
    use kube_event_bridge::shard::Shard;
    let server = ApiServer::start().await;
    for i in 0..3 {
        server.create(typed(&configmap("payments", &format!("cm-{i}"), "1")));
    }
    let factory = factory_on(&server, 500, false, 16);
    let of_shard = |index| {
        let shard = Shard { index, count: 2 };
        let informer = factory.informer_for(
            &configmaps(),
            InformerKey {
                shard: Some(shard),
                ..key(Some("payments"))
            },
            None,
        );
        (shard.holds_namespace("payments"), informer)
    };
    let (a, b) = (of_shard(0), of_shard(1));
    let ((_, outside), (_, inside)) = if a.0 { (b, a) } else { (a, b) };
    let cancel = CancellationToken::new();
    factory.start(&cancel);
    wait::until("both synced", PATIENCE, async || {
        outside.has_synced() && inside.has_synced()
    })
    .await;
    assert_eq!(inside.indexer().list().len(), 3);
    assert!(outside.indexer().list().is_empty());
    // Only the holding shard's informer asked: one list and one watch.
    let counts = server.counts("/api/v1/namespaces/payments/configmaps");
    assert_eq!((counts.lists, counts.watches), (1, 1), "{counts:?}");
    cancel.cancel();
}

/// With `streaming_list` (a watch-list echoes no `shardInfo`), a sharded informer tells
/// whether the server applies its selector from a list of one object: client-side filtering
/// is reported (`client_side_shards`) where the server ignores the selector, and not where it
/// applies it.
#[tokio::test]
async fn a_streaming_sharded_informer_tells_server_from_client_side_filtering() {
    use kube_event_bridge::shard::Shard;
    for server_side in [true, false] {
        let server = ApiServer::start().await;
        server.set_shard_selectors(server_side);
        for ns in ["payments", "orders", "auth"] {
            server.create(typed(&configmap(ns, "cm", "1")));
        }
        let factory = factory_on(&server, 500, true, 16);
        let informer = factory.informer_for(
            &configmaps(),
            InformerKey {
                shard: Some(Shard { index: 0, count: 2 }),
                ..key(None)
            },
            None,
        );
        let cancel = CancellationToken::new();
        factory.start(&cancel);
        wait::until("synced", PATIENCE, async || informer.has_synced()).await;
        let client_side = factory.client_side_shards();
        assert_eq!(
            client_side.is_empty(),
            server_side,
            "server applies the selector: {server_side}; client-side: {client_side:?}"
        );
        cancel.cancel();
    }
}
