//! The admin HTTP server: `/metrics` (Prometheus text), `/healthz` (the process serves and no
//! sink failed for good) and
//! `/readyz` (every informer synced and the API server reachable).

use std::sync::Arc;

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::metrics::Metrics;

/// The admin HTTP server.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address to listen on; port 0 picks a free port (logged at start).
    #[serde(default = "default_admin_address")]
    pub address: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: default_admin_address(),
        }
    }
}

fn default_admin_address() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}

/// `Ok` with notes (pending or refused resources, which do not make the service unready:
/// it exports what it can) when ready; the reasons when not.
pub type Readiness = Arc<dyn Fn() -> Result<Vec<String>, Vec<String>> + Send + Sync>;

/// What `/healthz` answers: `Err` (503, with the reasons) when the process can never work
/// again without a restart (a sink's producer failed for good).
pub type Liveness = Arc<dyn Fn() -> Result<(), Vec<String>> + Send + Sync>;

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    readiness: Readiness,
    liveness: Liveness,
}

/// Serves on `listener` until `cancel` fires.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    liveness: Liveness,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .with_state(AppState {
            metrics,
            readiness,
            liveness,
        });
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
}

async fn render_metrics(State(s): State<AppState>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

async fn live(State(s): State<AppState>) -> impl IntoResponse {
    match (s.liveness)() {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(reasons) => (StatusCode::SERVICE_UNAVAILABLE, reasons.join("\n") + "\n"),
    }
}

async fn ready(State(s): State<AppState>) -> impl IntoResponse {
    match (s.readiness)() {
        Ok(notes) => (
            StatusCode::OK,
            std::iter::once("ok".to_owned())
                .chain(notes)
                .collect::<Vec<_>>()
                .join("\n")
                + "\n",
        ),
        Err(reasons) => (StatusCode::SERVICE_UNAVAILABLE, reasons.join("\n") + "\n"),
    }
}
