//! What more than one of the CLI's test files needs: a Stripe delivery signed with a secret
//! and handed to ingest, as the provider (or a forger) sends it.

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
        })
        .await
}
