//! Opening what the routes publish to: every configured sink, the checkpoint store of each
//! sink that resumes (where it can keep one), and how each sink is delivered to.

use std::{collections::HashMap, sync::Arc};

use tracing::info;

use super::error::Error;
use crate::{
    config::{Config, SinkType},
    metrics::Metrics,
    pipeline::{Budget, Delivery},
    sinks::{
        CheckpointStore, Sink,
        kafka::{KafkaCheckpointStore, KafkaSink},
        nats::{NatsCheckpointStore, NatsMode, NatsSink},
        stdout::{FileCheckpointStore, StdoutSink},
    },
    workqueue::TokenBucket,
};

/// The opened sinks, by name.
pub(super) struct Opened {
    /// Every sink.
    pub(super) sinks: HashMap<String, Arc<dyn Sink>>,
    /// The Kafka sinks again, for creating topics.
    pub(super) kafka_sinks: HashMap<String, Arc<KafkaSink>>,
    /// The checkpoint store of each sink that resumes and can keep one.
    pub(super) stores: HashMap<String, Arc<dyn CheckpointStore>>,
    /// How each sink is delivered to, and the budget its routes share (`max_pending`).
    pub(super) deliveries: Deliveries,
}

/// How each sink is delivered to, and the budget its routes share (`max_pending`), by name.
pub(super) type Deliveries = HashMap<String, (Arc<Delivery>, Arc<Budget>)>;

impl Opened {
    /// The sinks as the routes of shard `shard` use them (see
    /// [`crate::sinks::Sink::shard_view`]: with sharding, each shard's terms publish on a
    /// producer or connection of their own), by name, and their deliveries (the rate limit
    /// and `max_pending` stay the sink's, shared by its shards).
    pub(super) fn for_shard(
        &self,
        shard: crate::shard::Shard,
    ) -> (HashMap<String, Arc<dyn Sink>>, Deliveries) {
        if shard.is_whole() {
            return (self.sinks.clone(), self.deliveries.clone());
        }
        let views: HashMap<String, Arc<dyn Sink>> = self
            .sinks
            .iter()
            .map(|(name, s)| {
                let view = s.clone().shard_view(shard).unwrap_or_else(|| s.clone());
                (name.clone(), view)
            })
            .collect();
        let view = |s: &Arc<dyn Sink>| views[s.name()].clone();
        let deliveries = self
            .deliveries
            .iter()
            .map(|(name, (d, budget))| {
                let delivery = Delivery {
                    sink: view(&d.sink),
                    dead_letter: d.dead_letter.as_ref().map(view),
                    publish_limit: d.publish_limit.clone(),
                    max_retries: d.max_retries,
                    in_flight: d.in_flight.clone(),
                };
                (name.clone(), (Arc::new(delivery), budget.clone()))
            })
            .collect();
        (views, deliveries)
    }
}

/// Opens every sink of `config` (connecting to brokers), their checkpoint stores, and their
/// deliveries.
pub(super) async fn open(config: &Config, metrics: &Metrics) -> Result<Opened, Error> {
    let mut sinks: HashMap<String, Arc<dyn Sink>> = HashMap::new();
    let mut kafka_sinks: HashMap<String, Arc<KafkaSink>> = HashMap::new();
    let mut nats_sinks: HashMap<String, Arc<NatsSink>> = HashMap::new();
    for s in &config.sinks {
        let sink: Arc<dyn Sink> = match s.kind {
            SinkType::Stdout => {
                let path = s.stdout.as_ref().and_then(|o| o.path.as_deref());
                Arc::new(StdoutSink::open(&s.name, path).await?)
            }
            SinkType::Nats => {
                let sink = Arc::new(
                    NatsSink::connect(&s.name, s.nats.as_ref().expect("validated")).await?,
                );
                nats_sinks.insert(s.name.clone(), sink.clone());
                sink
            }
            SinkType::Kafka => {
                let cfg = s.kafka.as_ref().expect("validated");
                let sink = Arc::new(KafkaSink::connect(&s.name, cfg).await?.with_transactions(
                    &config.cluster,
                    cfg,
                    metrics,
                ));
                kafka_sinks.insert(s.name.clone(), sink.clone());
                sink
            }
        };
        sinks.insert(s.name.clone(), sink);
    }
    let mut stores: HashMap<String, Arc<dyn CheckpointStore>> = HashMap::new();
    for s in config.sinks.iter().filter(|s| s.resume) {
        let store: Option<Arc<dyn CheckpointStore>> = match s.kind {
            SinkType::Stdout => s
                .stdout
                .as_ref()
                .and_then(|o| o.path.as_deref())
                .map(|path| Arc::new(FileCheckpointStore::beside(path)) as _),
            SinkType::Kafka => {
                let cfg = s.kafka.as_ref().expect("validated");
                let sink = &kafka_sinks[&s.name];
                Some(Arc::new(
                    KafkaCheckpointStore::open(&s.name, cfg, sink).await?,
                ))
            }
            SinkType::Nats => {
                let cfg = s.nats.as_ref().expect("validated");
                match cfg.mode {
                    NatsMode::Jetstream => {
                        let sink = &nats_sinks[&s.name];
                        Some(Arc::new(
                            NatsCheckpointStore::open(&s.name, cfg, sink).await?,
                        ))
                    }
                    NatsMode::Core => None,
                }
            }
        };
        match store {
            Some(store) => {
                info!(sink = %s.name, checkpoint = %store.describe(), "Resume on");
                stores.insert(s.name.clone(), store);
            }
            None => info!(sink = %s.name, kind = ?s.kind,
            "Resume off: this sink keeps no checkpoint (plain standard output, or core NATS)"),
        }
    }
    let mut deliveries = HashMap::new();
    for s in &config.sinks {
        let delivery = Delivery {
            sink: sinks[&s.name].clone(),
            dead_letter: s.dead_letter.as_ref().map(|d| sinks[d].clone()),
            publish_limit: s
                .rate_limit
                .as_ref()
                .map(|l| Arc::new(TokenBucket::new(l.qps, l.burst))),
            max_retries: s.retry.max_retries,
            in_flight: Delivery::in_flight(s.objects_in_flight(), s.bytes_in_flight()),
        };
        deliveries.insert(
            s.name.clone(),
            (Arc::new(delivery), Arc::new(Budget::new(s.max_pending))),
        );
    }
    Ok(Opened {
        sinks,
        kafka_sinks,
        stores,
        deliveries,
    })
}
