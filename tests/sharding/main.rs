//! Horizontal sharding with the real binary, checked as a consumer sees it: what the stream
//! or topic holds, folded per key in its order, compared with the API server's objects. One
//! test binary (each costs link time), a module per API server:
//!
//! - [`test_server`]: the Kubernetes API test server (tests/support/api_server.rs), many
//!   objects changing fast, replicas SIGKILLed, joining and leaving, into JetStream or Kafka.
//! - [`real_cluster`]: a real kube-apiserver v1.36 and etcd 3.6 with the
//!   `ShardedListAndWatch` gate on and off, shard count changes, and the single-leader mode
//!   beside sharded replicas.
//!
//! Sharding also shows elsewhere, beside what it changes: per-shard sink terms in
//! tests/kafka.rs and tests/nats.rs, sharded exactly-once in tests/kafka_eos.rs and
//! tests/takeover.rs, sharded informers in tests/informer.rs and tests/discovery.rs, the
//! random hand-overs of tests/model.rs, and the sharded overlay's RBAC in tests/deploy.rs.

#[path = "../support/mod.rs"]
mod support;

mod real_cluster;
mod test_server;

/// Two sharded scenarios at a time in this binary: each starts three to five replicas (debug
/// builds), and four at once on 2 cores starved Lease renewals past their 3 s deadline.
static AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
