//! What more than one of the CLI's test files needs: a Stripe delivery signed with a secret
//! and handed to ingest, as the provider (or a forger) sends it; the buffer's queues on moto
//! and a delivery as ingest buffers it.

use shared::domain::Scheme;
use shared::ingest::{Delivery, IngestError, Ingestor, Received, unix_now};
use shared::secrets::SigningSecret;

/// Event `id` with `body`, signed now as Stripe signs with `secret`, received by `source_id`.
pub async fn post_stripe(
    ingestor: &Ingestor,
    source_id: &str,
    secret: &str,
    id: &str,
    body: &[u8],
) -> Result<Received, IngestError> {
    let headers: http::HeaderMap = shared::signature::sign(
        Scheme::Stripe,
        &SigningSecret::new(secret),
        id,
        unix_now(),
        body,
    )
    .unwrap()
    .into_iter()
    .collect();
    ingestor
        .receive(Delivery {
            source_id,
            headers: &headers,
            body,
            method: "POST",
            url: None,
            source_ip: None,
            client_certificate: None,
        })
        .await
}

/// A delivery to the source `pay`, buffered now, as ingest would have sent it.
pub fn pay_delivery(delivery_id: &str, body: &[u8]) -> shared::buffer::BufferedDelivery {
    shared::buffer::BufferedDelivery {
        envelope: shared::buffer::Envelope {
            v: shared::buffer::ENVELOPE_VERSION,
            delivery_id: delivery_id.into(),
            verified_layout: None,
            source_id: "pay".into(),
            received_at_micros: unix_now() * 1_000_000,
            verified_with: "current".into(),
            headers: Default::default(),
            signed_headers: vec![],
            signed_digest: None,
            element_digests: Vec::new(),
        },
        body: body.to_vec(),
    }
}

/// The buffer's queues on moto (`MOTO_ENDPOINT`, which the test command starts), named uniquely.
pub async fn buffer_queues() -> (shared::buffer::BufferQueue, String, String) {
    let endpoint = std::env::var("MOTO_ENDPOINT").expect("MOTO_ENDPOINT: run scripts/test");
    let aws = shared::aws::AwsEndpoint {
        endpoint_url: Some(endpoint),
        region: Some("us-east-1".into()),
    };
    // Unique per test too: tests of one process run in the same second.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "cli-buffer-{}-{}-{}",
        std::process::id(),
        unix_now(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let buffer = hookctl::serve::create_buffer_queue(&aws, &name, 5, 30)
        .await
        .unwrap();
    let (queue, dead_letters) = (
        buffer.queue_url().to_owned(),
        buffer.dead_letter_queue_url().unwrap().to_owned(),
    );
    (buffer, queue, dead_letters)
}
