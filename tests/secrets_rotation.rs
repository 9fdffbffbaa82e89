//! Signing secrets from Secrets Manager (moto in server mode, started by the test command):
//! current and previous versions accepted, a rotation picked up after the cache TTL without a
//! restart and seen whole (current and previous together), a retired secret refused. The cache's
//! time is a clock the tests move: no sleeps.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use pipeline_tests::*;
use serde_json::json;
use shared::domain::Scheme;
use shared::ingest::Ingestor;
use shared::secrets::{AwsSecrets, AwsSecretsSettings, Clock, SecretStore};
use sqlx::PgPool;

async fn post(app: &Ingestor, secret: &str, id: &str) -> StatusCode {
    let d = delivery(Scheme::Stripe, secret, id, now(), json!({}));
    post_to(app, "stripe", d.headers, &d.body).await.status
}

/// A clock the test moves: the cache's TTL is crossed without sleeping.
#[derive(Clone)]
struct TestClock(Arc<Mutex<Instant>>);

impl TestClock {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }

    fn advance(&self, by: Duration) {
        *self.0.lock().unwrap() += by;
    }

    fn clock(&self) -> Clock {
        let at = self.0.clone();
        Arc::new(move || *at.lock().unwrap())
    }
}

async fn rotate(admin: &aws_sdk_secretsmanager::Client, name: &str, value: &str) {
    // AWSCURRENT becomes the new value, AWSPREVIOUS the old one.
    admin
        .put_secret_value()
        .secret_id(name)
        .secret_string(value)
        .send()
        .await
        .unwrap();
}

/// The ingest function reading `name` from moto through a cache whose time `clock` gives.
async fn app_with_secret(pool: PgPool, name: &str, ttl: Duration, clock: &TestClock) -> TestApp {
    let secrets = AwsSecrets::with_clock(
        &AwsSecretsSettings {
            endpoint_url: Some(moto_endpoint()),
            region: Some("us-east-1".into()),
            ttl,
        },
        clock.clock(),
    )
    .await;
    TestApp::with_limits(
        pool,
        &[source("stripe", TENANT, Scheme::Stripe, name)],
        SecretStore::Aws(secrets),
        Duration::from_secs(60),
        MAX_BODY,
    )
    .await
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rotated_secret_is_picked_up_without_a_restart(pool: PgPool) {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stripe", "whsec_first").await;
    let ttl = Duration::from_secs(60);
    let clock = TestClock::new();
    let app = app_with_secret(pool.clone(), &name, ttl, &clock).await;

    assert_eq!(
        post(&app.ingestor, "whsec_first", "evt_1").await,
        StatusCode::OK
    );
    assert_eq!(
        post(&app.ingestor, "whsec_second", "evt_2").await,
        StatusCode::UNAUTHORIZED
    );

    rotate(&admin, &name, "whsec_second").await;
    clock.advance(ttl + Duration::from_secs(1));

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
    rotate(&admin, &name, "whsec_third").await;
    clock.advance(ttl + Duration::from_secs(1));
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

/// The current and previous values are one snapshot: at no moment after a rotation is the new
/// secret accepted while the retired one is refused (providers switch over gradually, and
/// deliveries signed with the old secret are still in flight and in their retry queues).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rotation_is_seen_whole_at_every_moment_of_the_cache_ttl(pool: PgPool) {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stripe", "whsec_old").await;
    let ttl = Duration::from_secs(60);
    let clock = TestClock::new();
    let app = app_with_secret(pool.clone(), &name, ttl, &clock).await;

    // Warm the cache at staggered moments, then rotate in the middle of its life.
    assert_eq!(post(&app.ingestor, "whsec_old", "w1").await, StatusCode::OK);
    clock.advance(ttl / 3);
    assert_eq!(post(&app.ingestor, "whsec_old", "w2").await, StatusCode::OK);
    rotate(&admin, &name, "whsec_new").await;

    let mut new_seen = false;
    for step in 0..12 {
        clock.advance(ttl / 6);
        let old = post(&app.ingestor, "whsec_old", &format!("old-{step}")).await;
        let new = post(&app.ingestor, "whsec_new", &format!("new-{step}")).await;
        assert_eq!(
            old,
            StatusCode::OK,
            "step {step}: the retired secret was refused"
        );
        if new == StatusCode::OK {
            new_seen = true;
        } else {
            assert!(
                !new_seen,
                "step {step}: the new secret was refused after being accepted"
            );
            assert_eq!(new, StatusCode::UNAUTHORIZED);
        }
    }
    assert!(new_seen, "the rotation was picked up within two TTLs");
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_missing_secret_is_a_500_and_stores_nothing(pool: PgPool) {
    let endpoint = moto_endpoint();
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some(endpoint),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await;
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

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_unreachable_secrets_manager_is_a_503(pool: PgPool) {
    let secrets = AwsSecrets::connect(&AwsSecretsSettings {
        endpoint_url: Some("http://127.0.0.1:1".into()),
        region: Some("us-east-1".into()),
        ttl: Duration::from_secs(60),
    })
    .await;
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
