//! The local runner: the ingest Lambda's handler served over plain HTTP, so `curl` with a signed
//! body lands a row in the local database. Requests go through the same `ingest::handler` API
//! Gateway calls in AWS, with the route's `{source_id}` passed as a path parameter.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lambda_http::RequestExt;
use shared::ingest::Ingestor;

/// `POST /webhooks/{source_id}` and `GET /health`. `max_body_bytes` is the ingest limit: the
/// router lets one byte more through so the handler, not the router, answers 413.
pub fn router(ingestor: Arc<Ingestor>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/webhooks/{source_id}", post(receive))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(max_body_bytes.saturating_add(1)))
        .with_state(ingestor)
}

/// Serves until the listener fails or the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).await
}

async fn receive(
    State(ingestor): State<Arc<Ingestor>>,
    Path(source_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut request = lambda_http::http::Request::builder()
        .method("POST")
        .uri(format!("/webhooks/{source_id}"))
        .body(lambda_http::Body::Binary(body.to_vec()))
        .expect("valid request parts");
    *request.headers_mut() = headers;
    let request =
        request.with_path_parameters(HashMap::from([("source_id".to_owned(), source_id)]));
    match ingest::handler(request, &ingestor).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            (parts.status, parts.headers, body.to_vec()).into_response()
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}
