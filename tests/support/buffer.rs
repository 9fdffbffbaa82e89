//! What the buffer's tests need: a PostgreSQL that can be made unreachable under a warm ingest
//! (the [`DatabaseProxy`] the fault drill uses too, cut and restored), and SQS queues on moto.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use shared::buffer::BufferQueue;
use sqlx::PgPool;

pub use hookctl::db_proxy::DatabaseProxy;

/// A buffer queue and its dead-letter queue on moto, named uniquely (moto keeps state across
/// tests), with the stack's redrive policy (`max_receives` receives, then the dead-letter queue)
/// and the given visibility timeout.
pub async fn new_buffer_queue(max_receives: u32, visibility_seconds: u32) -> BufferQueue {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let endpoint = shared::aws::AwsEndpoint {
        endpoint_url: Some(crate::moto_endpoint()),
        region: Some("us-east-1".into()),
    };
    let name = format!(
        "buffer-{}-{}-{}",
        std::process::id(),
        crate::now(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    hookctl::serve::create_buffer_queue(&endpoint, &name, max_receives, visibility_seconds)
        .await
        .unwrap()
}

/// Everything waiting in the queue at `url`, received (and made visible again at once).
pub async fn peek(queue: &BufferQueue, url: &str) -> Vec<shared::buffer::queue::Received> {
    let mut all = Vec::new();
    loop {
        let batch = queue.receive_from(url, 10, 30, 0).await.unwrap();
        if batch.is_empty() {
            break;
        }
        all.extend(batch);
    }
    for m in &all {
        queue
            .client()
            .change_message_visibility()
            .queue_url(url)
            .receipt_handle(&m.receipt_handle)
            .visibility_timeout(0)
            .send()
            .await
            .unwrap();
    }
    all
}

/// Ingest for every scheme's source, reaching its database through a [`DatabaseProxy`] and
/// buffering to `queue` in `mode`. The app's `pool` is the direct one, for the test's reads.
pub async fn buffered_app(
    pool: PgPool,
    mode: shared::buffer::BufferMode,
    queue: BufferQueue,
    max_body_bytes: usize,
) -> (crate::TestApp, DatabaseProxy) {
    buffered_app_holding(pool, mode, queue, max_body_bytes, Duration::ZERO).await
}

/// [`buffered_app`] whose ingest, once the database failed a delivery, sends the next ones
/// straight to the buffer for `spill_hold`.
pub async fn buffered_app_holding(
    pool: PgPool,
    mode: shared::buffer::BufferMode,
    queue: BufferQueue,
    max_body_bytes: usize,
    spill_hold: Duration,
) -> (crate::TestApp, DatabaseProxy) {
    // Every scheme's source, a Mailgun one (a layout that signs values, not the body) and a
    // Microsoft Graph one (a token inside each element of a batch).
    let mut sources = crate::sources_for_every_scheme();
    let mailgun = shared::domain::Scheme::Mailgun;
    let graph = shared::domain::Scheme::MicrosoftGraph;
    for (name, scheme) in [("mailgun", mailgun), ("graph", graph)] {
        sources.push(crate::source(
            name,
            crate::TENANT,
            scheme,
            &format!("secret/{scheme}"),
        ));
    }
    shared::sources::apply(&pool, &sources)
        .await
        .expect("store sources");
    let secrets = shared::secrets::SecretStore::memory(
        crate::SCHEMES.iter().chain([&mailgun, &graph]).map(|s| {
            (
                format!("secret/{s}"),
                shared::secrets::SecretSet::new(crate::secret_of(*s), None),
            )
        }),
    );
    let proxy = DatabaseProxy::to(&pool)
        .await
        .expect("a proxy on 127.0.0.1");
    let through = proxy.pool(&pool);
    let registry = Arc::new(shared::sources::SourceRegistry::new(
        through.clone(),
        Duration::from_secs(300),
    ));
    let ingestor = shared::ingest::Ingestor::new(
        through,
        registry,
        Arc::new(secrets),
        shared::ingest::IngestLimits { max_body_bytes },
    )
    .with_buffer(shared::ingest::Buffer::new(
        mode,
        queue,
        Duration::from_millis(1500),
        spill_hold,
    ));
    (
        crate::TestApp {
            pool,
            ingestor: Arc::new(ingestor),
        },
        proxy,
    )
}
