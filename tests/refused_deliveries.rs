//! Deliveries refused before anything is stored are kept for the operator, bounded, with their
//! reason and the safe parts of the request: a wrong secret and an attack read differently.
//! Through the ingest handler, against a real PostgreSQL.

use http::StatusCode;
use pipeline_tests::*;
use shared::domain::Scheme;
use shared::operator::{self, OperatorRequest};
use shared::secrets::{SecretSet, SecretStore};
use sqlx::PgPool;

async fn stripe_app(pool: &PgPool, sources: &[(&str, &str)]) -> TestApp {
    let list: Vec<_> = sources
        .iter()
        .map(|(id, _)| source(id, TENANT, Scheme::Stripe, &format!("secret/{id}")))
        .collect();
    let secrets = SecretStore::memory(
        sources
            .iter()
            .map(|(id, secret)| (format!("secret/{id}"), SecretSet::new(*secret, None))),
    );
    TestApp::new(pool.clone(), &list, secrets).await
}

#[derive(Debug, sqlx::FromRow)]
struct Kept {
    source_id: String,
    status: i16,
    reason: String,
    check_failed: String,
    method: String,
    body_bytes: i32,
    body_sha256: Vec<u8>,
    header_names: Vec<String>,
    user_agent: Option<String>,
    also_refused: i32,
}

async fn kept(pool: &PgPool) -> Vec<Kept> {
    sqlx::query_as(
        "SELECT source_id, status, reason, check_failed, method, body_bytes, body_sha256, \
             header_names, user_agent, also_refused \
         FROM refused_deliveries ORDER BY refusal_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A forged signature and a stale timestamp are kept with their check, status and the
/// request's safe parts (header names, user agent, size, digest); nothing of a signature's
/// value. An unknown source's request is not kept (its id is the caller's to invent).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_refused_delivery_is_kept_with_its_reason_and_safe_parts(pool: PgPool) {
    let app = stripe_app(&pool, &[("pay", "whsec_right")]).await;
    let mut forged = delivery(Scheme::Stripe, "whsec_wrong", "evt_1", now(), json_none());
    set(
        &mut forged.headers,
        "user-agent",
        "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
    );
    let reply = app.post("pay", forged.headers.clone(), &forged.body).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    let stale = delivery(
        Scheme::Stripe,
        "whsec_right",
        "evt_2",
        now() - 3600,
        json_none(),
    );
    let reply = app.post("pay", stale.headers.clone(), &stale.body).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    let reply = app
        .post("nobody", forged.headers.clone(), &forged.body)
        .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);

    let rows = kept(&pool).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (first, second) = (&rows[0], &rows[1]);
    assert_eq!(
        (
            first.source_id.as_str(),
            first.status,
            first.reason.as_str()
        ),
        ("pay", 401, "signature")
    );
    assert_eq!(first.check_failed, "no_match");
    assert_eq!(second.check_failed, "stale_timestamp");
    assert_eq!(first.method, "POST");
    assert_eq!(first.body_bytes as usize, forged.body.len());
    let digest: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(&forged.body).into();
    assert_eq!(first.body_sha256, digest);
    assert!(first.header_names.contains(&"stripe-signature".to_owned()));
    assert_eq!(
        first.user_agent.as_deref(),
        Some("Stripe/1.0 (+https://stripe.com/docs/webhooks)")
    );
    let signature = forged.headers["stripe-signature"].to_str().unwrap();
    let anywhere: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM refused_deliveries AS r \
         WHERE to_jsonb(r)::text LIKE '%' || $1 || '%'",
    )
    .bind(signature.split("v1=").nth(1).unwrap())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(anywhere, 0, "no signature value is kept");
    assert!(events(&pool).await.is_empty());
}

/// A flood of forgeries costs a write a second for each source and check: the refusals in
/// between are counted into the next one kept, so the record still adds up to what was sent.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_flood_of_forgeries_is_kept_a_row_a_second_and_counted_whole(pool: PgPool) {
    let app = stripe_app(&pool, &[("pay", "whsec_right")]).await;
    let forged = delivery(Scheme::Stripe, "whsec_wrong", "evt_1", now(), json_none());
    let sent = 200;
    let started = std::time::Instant::now();
    for _ in 0..sent {
        let reply = app.post("pay", forged.headers.clone(), &forged.body).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    }
    let within_first_second = started.elapsed() < std::time::Duration::from_secs(1);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let reply = app.post("pay", forged.headers.clone(), &forged.body).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);

    let rows = kept(&pool).await;
    let counted: i64 = rows.iter().map(|r| 1 + i64::from(r.also_refused)).sum();
    assert_eq!(counted, sent + 1, "every refusal counted: {rows:?}");
    if within_first_second {
        assert_eq!(
            rows.len(),
            2,
            "one kept in the first second, one after: {rows:?}"
        );
    }
    assert!(rows.len() <= 4, "a row a second at most: {rows:?}");
}

/// Each source keeps its newest 100 refusals: day 60 holds what day one does.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_keeps_its_newest_hundred_refusals(pool: PgPool) {
    let _app = stripe_app(&pool, &[("pay", "whsec_right")]).await;
    for i in 0..150 {
        let detail = format!("refusal {i}");
        shared::store::refused_deliveries::record(
            &pool,
            &shared::store::refused_deliveries::NewRefusal {
                tenant_id: TENANT,
                source_id: "pay",
                status: 401,
                reason: "signature",
                check_failed: "no_match",
                detail: &detail,
                method: "POST",
                body_bytes: 2,
                body_sha256: [0; 32],
                header_names: vec![],
                user_agent: None,
                content_type: None,
                also_refused: 0,
            },
        )
        .await
        .unwrap();
    }
    let (count, oldest): (i64, String) = sqlx::query_as(
        "SELECT count(*), (SELECT detail FROM refused_deliveries ORDER BY refusal_id LIMIT 1) \
         FROM refused_deliveries",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((count, oldest.as_str()), (100, "refusal 50"));
}

/// A source whose every delivery is refused for a signature that does not match, with nothing
/// stored since, reads as a wrong secret; refusals beside stored deliveries read as requests
/// that are not the provider's (`hookctl refused`, the console).
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_wrong_secret_and_an_attack_read_differently(pool: PgPool) {
    let app = stripe_app(
        &pool,
        &[("misconfigured", "whsec_old"), ("attacked", "whsec_ok")],
    )
    .await;
    // The provider signs with a secret the first source does not hold.
    for i in 0..3 {
        let d = delivery(
            Scheme::Stripe,
            "whsec_new",
            &format!("evt_m{i}"),
            now(),
            json_none(),
        );
        app.post("misconfigured", d.headers, &d.body).await;
    }
    // Someone forges requests to the second, whose real deliveries keep landing.
    let forged = delivery(Scheme::Stripe, "whsec_guess", "evt_x", now(), json_none());
    app.post("attacked", forged.headers, &forged.body).await;
    let real = delivery(Scheme::Stripe, "whsec_ok", "evt_real", now(), json_none());
    let reply = app.post("attacked", real.headers, &real.body).await;
    assert_eq!(reply.status, StatusCode::OK);

    let answer = operator::handle(
        &pool,
        &shared::effects::EffectRegistry::standard(),
        OperatorRequest::ListRefused {
            source_id: None,
            limit: None,
        },
    )
    .await
    .unwrap();
    let answer = serde_json::to_value(answer).unwrap();
    let summary: Vec<(String, String, i64, bool)> = answer["last_day"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["source_id"].as_str().unwrap().to_owned(),
                s["check_failed"].as_str().unwrap().to_owned(),
                s["refused_last_day"].as_i64().unwrap(),
                s["stored_since"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("attacked".to_owned(), "no_match".to_owned(), 1, true),
            // Three refused within a second: one kept; the other two are counted into the
            // next one kept (and in the metric at once).
            ("misconfigured".to_owned(), "no_match".to_owned(), 1, false),
        ]
    );
    let readings: Vec<&str> = answer["last_day"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["reading"].as_str().unwrap())
        .collect();
    assert!(readings[0].contains("not the provider's"), "{readings:?}");
    assert!(
        readings[1].contains("secret the provider's"),
        "{readings:?}"
    );
}

fn json_none() -> serde_json::Value {
    serde_json::json!({})
}
