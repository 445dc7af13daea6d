//! Writing the lines (see [`super`]).

use std::path::Path;

use futures::{FutureExt, future::BoxFuture};
use tokio::{
    io::{AsyncWrite, AsyncWriteExt, BufWriter},
    sync::Mutex,
};

use crate::{
    message::Message,
    sinks::{Error, Result, Sink},
};

/// See [`super`].
pub struct StdoutSink {
    name: String,
    out: Mutex<BufWriter<Box<dyn AsyncWrite + Send + Unpin>>>,
}

impl StdoutSink {
    /// Writes to standard output, or appends to `path` when given.
    pub async fn open(name: &str, path: Option<&Path>) -> Result<Self> {
        let out: Box<dyn AsyncWrite + Send + Unpin> = match path {
            None => Box::new(tokio::io::stdout()),
            Some(path) => {
                let open_error = |cause| Error::Open {
                    what: path.display().to_string(),
                    cause,
                };
                let mut file = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .read(true)
                    .open(path)
                    .await
                    .map_err(open_error)?;
                // A process killed in the middle of a line left it unterminated: end it, so
                // that the first line of this run stays a line of its own.
                if ends_mid_line(&mut file).await.map_err(open_error)? {
                    file.write_all(b"\n").await.map_err(open_error)?;
                }
                // One write per line however long (tokio splits writes at 2 MiB otherwise).
                file.set_max_buf_size(usize::MAX);
                Box::new(file)
            }
        };
        Ok(Self {
            name: name.to_owned(),
            out: Mutex::new(BufWriter::new(out)),
        })
    }
}

/// Whether a non-empty file does not end with a newline.
async fn ends_mid_line(file: &mut tokio::fs::File) -> std::io::Result<bool> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let len = file.metadata().await?.len();
    if len == 0 {
        return Ok(false);
    }
    file.seek(std::io::SeekFrom::Start(len - 1)).await?;
    let mut last = [0u8];
    file.read_exact(&mut last).await?;
    Ok(last[0] != b'\n')
}

impl Sink for StdoutSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn publish<'a>(&'a self, message: &'a Message) -> BoxFuture<'a, Result<()>> {
        async move {
            // The line in one write: on a local filesystem, appends of other processes to the
            // same file (sharded replicas sharing it) land between lines, not inside one. Not
            // so on NFS.
            let mut line = Vec::with_capacity(message.payload.len() + 1);
            line.extend_from_slice(&message.payload);
            line.push(b'\n');
            let mut out = self.out.lock().await;
            out.flush().await.map_err(Error::Io)?;
            out.get_mut().write_all(&line).await.map_err(Error::Io)?;
            out.get_mut().flush().await.map_err(Error::Io)
        }
        .boxed()
    }

    fn flush(&self) -> BoxFuture<'_, Result<()>> {
        async move { self.out.lock().await.flush().await.map_err(Error::Io) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::informer::EventType;

    #[tokio::test]
    async fn appends_one_line_per_message_to_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = StdoutSink::open("file", Some(&path)).await.unwrap();
        for i in 0..3 {
            let m = Message {
                id: format!("u:{i}:added"),
                key: "ns/a".into(),
                event_type: EventType::Added,
                payload: format!("{{\"n\":{i}}}").into(),
                attributes: Vec::new(),
                content_type: crate::message::STRUCTURED_CONTENT_TYPE,
                resource: std::sync::Arc::new(crate::message::ResourceInfo {
                    cluster: "c".into(),
                    group: String::new(),
                    version: "v1".into(),
                    kind: "ConfigMap".into(),
                    plural: "configmaps".into(),
                }),
                namespace: Some("ns".into()),
                name: "a".into(),
                received: std::time::Instant::now(),
            };
            sink.publish(&m).await.unwrap();
        }
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":0}\n{\"n\":1}\n{\"n\":2}\n"
        );
    }

    #[tokio::test]
    async fn a_line_cut_by_a_crash_is_ended_before_new_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        std::fs::write(&path, "{\"n\":0}\n{\"n\":").unwrap();
        let sink = StdoutSink::open("file", Some(&path)).await.unwrap();
        sink.flush().await.unwrap();
        drop(sink);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":0}\n{\"n\":\n"
        );
    }

    #[tokio::test]
    async fn unopenable_path_is_a_final_error_naming_it() {
        let err = StdoutSink::open("file", Some(Path::new("/nonexistent-dir/x")))
            .await
            .err()
            .unwrap();
        assert!(!err.is_retriable());
        assert!(err.to_string().contains("/nonexistent-dir/x"), "{err}");
    }
}
