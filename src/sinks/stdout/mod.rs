//! The `stdout` sink: one structured CloudEvent per line, on standard output or appended to a
//! file. It needs no broker, so it is the default. A message counts as delivered once its line
//! has been written and flushed to the operating system; its checkpoint store syncs the file
//! to disk before each checkpoint write.

mod checkpoint;
mod config;
mod sink;

pub use checkpoint::FileCheckpointStore;
pub use config::StdoutSinkConfig;
pub use sink::StdoutSink;
