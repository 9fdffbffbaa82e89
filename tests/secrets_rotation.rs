//! Signing secrets from Secrets Manager (moto in server mode, started by the test command):
//! current and previous versions accepted, a rotation picked up after the cache TTL without a
//! restart, a retired secret refused.

use std::time::Duration;

use http::StatusCode;
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::ingest::Ingestor;
use shared::secrets::{AwsSecrets, AwsSecretsSettings, SecretStore};
use sqlx::PgPool;

fn moto_endpoint() -> String {
    std::env::var("MOTO_ENDPOINT")
        .expect("MOTO_ENDPOINT is not set: run the tests with scripts/test, which starts moto")
}

async fn admin_client(endpoint: &str) -> aws_sdk_secretsmanager::Client {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(aws_config::Region::new("us-east-1"))
        .load()
        .await;
    aws_sdk_secretsmanager::Client::new(&config)
}

async fn post(app: &Ingestor, secret: &str, id: &str) -> StatusCode {
    let d = delivery(Scheme::Stripe, secret, id, now(), json!({}));
    post_to(app, "stripe", d.headers, &d.body).await.status
}

#[sqlx::test(migrations = "../migrations")]
async fn a_rotated_secret_is_picked_up_without_a_restart(pool: PgPool) {
    let endpoint = moto_endpoint();
    let admin = admin_client(&endpoint).await;
    // A unique name per run: moto keeps state across tests.
    let name = format!(
        "webhooks/stripe/{}",
        std::process::id() as u64 * 1000 + (now() % 1000) as u64
    );
    admin
        .create_secret()
        .name(&name)
        .secret_string("whsec_first")
        .send()
        .await
        .unwrap();

    let ttl = Duration::from_millis(700);
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some(endpoint.clone()),
        region: Some("us-east-1".into()),
        ttl,
    })
    .await
    .unwrap();
    let app = TestApp::with_limits(
        pool.clone(),
        &[source("stripe", TENANT, Scheme::Stripe, &name)],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await;

    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_1").await,
        StatusCode::OK
    );
    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_2").await,
        StatusCode::UNAUTHORIZED
    );

    // Rotation: AWSCURRENT becomes the new value, AWSPREVIOUS the old one.
    admin
        .put_secret_value()
        .secret_id(&name)
        .secret_string("whsec_second")
        .send()
        .await
        .unwrap();
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;

    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_3").await,
        StatusCode::OK,
        "new secret after the TTL"
    );
    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_4").await,
        StatusCode::OK,
        "old secret still accepted as previous"
    );
    assert_eq!(
        event(&pool, TENANT, "evt_3").await.unwrap().verified_with,
        "current"
    );
    assert_eq!(
        event(&pool, TENANT, "evt_4").await.unwrap().verified_with,
        "previous"
    );

    // A second rotation retires the first secret.
    admin
        .put_secret_value()
        .secret_id(&name)
        .secret_string("whsec_third")
        .send()
        .await
        .unwrap();
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_5").await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_6").await,
        StatusCode::OK
    );
    assert_eq!(
        post(&app.ingestor, "whsec_third", "evt_7").await,
        StatusCode::OK
    );

    let stored: Vec<String> = events(&pool)
        .await
        .into_iter()
        .map(|r| r.external_id)
        .collect();
    assert_eq!(stored, ["evt_1", "evt_3", "evt_4", "evt_6", "evt_7"]);
}

#[sqlx::test(migrations = "../migrations")]
async fn a_missing_secret_is_a_500_and_stores_nothing(pool: PgPool) {
    let endpoint = moto_endpoint();
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some(endpoint),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await
    .unwrap();
    let app = TestApp::with_limits(
        pool.clone(),
        &[source(
            "stripe",
            TENANT,
            Scheme::Stripe,
            "webhooks/does-not-exist",
        )],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await;
    assert_eq!(
        post(&app.ingestor, "whsec_any", "evt_1").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert!(events(&pool).await.is_empty());
}

#[sqlx::test(migrations = "../migrations")]
async fn an_unreachable_secrets_manager_is_a_503(pool: PgPool) {
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some("http://127.0.0.1:1".into()),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await
    .unwrap();
    let app = TestApp::with_limits(
        pool.clone(),
        &[source("stripe", TENANT, Scheme::Stripe, "webhooks/x")],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await;
    assert_eq!(
        post(&app.ingestor, "whsec_any", "evt_1").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(events(&pool).await.is_empty());
}
