//! Provider address ranges as a second check (issue 50, point 5), against a real PostgreSQL and
//! a local stand-in for the provider's published list: the ranges pass keeps the list with when
//! it was read (and keeps it through a failed try); a signed delivery from outside is stored
//! and counted by a source that observes, refused 403 (and the refusal kept) by one that
//! enforces; a stale or never read list refuses nothing and is reported; IPv6 as IPv4. Through
//! the ingest handler with API Gateway's `requestContext.http.sourceIp`, and the local runner
//! over real HTTP from two loopback addresses.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode as AxumStatus;
use http::StatusCode;
use pipeline_tests::*;
use serde_json::json;
use shared::address_ranges::{
    self, AddressCheck, RangeCache, RangeRefresher, RangesOutcome, RangesRun, RangesSettings,
};
use shared::anomaly::{self, AnomalySettings};
use shared::domain::Scheme;
use shared::ingest::{IngestLimits, Ingestor};
use shared::sources::{self, Source, SourceRegistry};
use shared::store::provider_address_ranges::{self, StoredRanges};
use sqlx::PgPool;

/// What the stand-in answers: a status and a body.
type Answer = Arc<Mutex<(u16, String)>>;

/// A local stand-in for a provider's published list (GitHub's meta API): answers `GET /meta`
/// with whatever `answer` holds at the time.
async fn stand_in(answer: &Answer) -> String {
    let answer = answer.clone();
    let app = axum::Router::new().route(
        "/meta",
        axum::routing::get(move || {
            let answer = answer.clone();
            async move {
                let (status, body) = answer.lock().unwrap().clone();
                (
                    AxumStatus::from_u16(status).unwrap(),
                    [("content-type", "application/json")],
                    body,
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{address}/meta")
}

fn answer(status: u16, body: serde_json::Value) -> Answer {
    Arc::new(Mutex::new((status, body.to_string())))
}

fn set_answer(answer: &Answer, status: u16, body: &str) {
    *answer.lock().unwrap() = (status, body.to_owned());
}

/// The ranges pass reading GitHub's list at `url`; `refresh_after` zero: every list is due.
fn refresher(pool: &PgPool, url: &str, refresh_after: Duration) -> RangeRefresher {
    RangeRefresher::new(
        pool.clone(),
        RangesSettings {
            refresh_after,
            request_timeout: Duration::from_secs(5),
            urls: RangesSettings::parse_urls(&format!("github={url}")).unwrap(),
        },
    )
}

async fn refresh(pool: &PgPool, url: &str) -> RangesOutcome {
    match refresher(pool, url, Duration::ZERO)
        .run_once("test")
        .await
        .unwrap()
    {
        RangesRun::Completed { outcome, .. } => outcome,
        skipped => panic!("{skipped:?}"),
    }
}

/// A GitHub source with the given check (`None`: its default, observe).
fn github_source(check: Option<AddressCheck>) -> Source {
    Source {
        address_check: check,
        ..source("github", TENANT, Scheme::Github, "secret/github")
    }
}

/// The ingest handler over `sources`, reading sources and ranges afresh on every delivery (a
/// cache of zero TTL), so a refresh or a backdated list is seen at once.
async fn app(pool: &PgPool, sources: &[Source]) -> TestApp {
    sources::apply(pool, sources).await.unwrap();
    let ingestor = Ingestor::new(
        pool.clone(),
        Arc::new(SourceRegistry::new(pool.clone(), Duration::ZERO)),
        Arc::new(secrets_for_every_scheme()),
        IngestLimits {
            max_body_bytes: MAX_BODY,
        },
    )
    .with_address_ranges(RangeCache::new(pool.clone(), Duration::ZERO));
    TestApp {
        pool: pool.clone(),
        ingestor: Arc::new(ingestor),
    }
}

/// GitHub's delivery `id` (its body made distinct by `n`, so no two are one replayed body).
fn github(id: &str, n: i64) -> Delivery {
    delivery(
        Scheme::Github,
        &secret_of(Scheme::Github),
        id,
        now(),
        json!({ "n": n }),
    )
}

async fn post(app: &TestApp, d: &Delivery, from: &str) -> Reply {
    post_from(
        &app.ingestor,
        "github",
        d.headers.clone(),
        &d.body,
        Some(from),
    )
    .await
}

async fn stored_ranges(pool: &PgPool) -> Vec<StoredRanges> {
    provider_address_ranges::list(pool).await.unwrap()
}

#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
struct Outside {
    source_address: String,
    admitted: i64,
    refused: i64,
}

async fn outside(pool: &PgPool) -> Vec<Outside> {
    sqlx::query_as(
        "SELECT host(source_address) AS source_address, admitted, refused \
         FROM deliveries_outside_ranges ORDER BY source_address",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn breaches(pool: &PgPool) -> Vec<String> {
    anomaly::run_once(pool, &AnomalySettings::default(), "test")
        .await
        .unwrap()
        .breaches
}

async fn measured(pool: &PgPool, check: &str) -> Option<f64> {
    sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE check_name = $1 ORDER BY run_id DESC LIMIT 1",
    )
    .bind(check)
    .fetch_one(pool)
    .await
    .unwrap()
}

const GITHUB_HOOKS: &str = r#"{"verifiable_password_authentication":false,"hooks":["192.0.2.0/24","2001:db8::/32"],"web":["198.51.100.0/24"]}"#;

/// A refresh against the stand-in keeps the list with when it was read, in a recorded run; a
/// second refresh replaces it; one not yet due leaves it alone; a stand-in answering 500 (or
/// something that is not the list) keeps the old list and counts the failure. A provider no
/// source checks against is not asked.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_refresh_keeps_the_list_with_when_it_was_read_and_a_failed_one_keeps_the_old(
    pool: PgPool,
) {
    let github_list = answer(200, serde_json::from_str(GITHUB_HOOKS).unwrap());
    let url = stand_in(&github_list).await;
    // A GitHub source observes by default; the Stripe source does not check.
    let stripe = Source {
        address_check: Some(AddressCheck::Off),
        ..source("stripe", TENANT, Scheme::Stripe, "secret/stripe")
    };
    sources::apply(&pool, &[github_source(None), stripe])
        .await
        .unwrap();

    let before = chrono::Utc::now();
    let first = refresh(&pool, &url).await;
    assert_eq!(
        first,
        RangesOutcome {
            providers: 1,
            fetched: 1,
            not_due: 0,
            failed: vec![],
        }
    );
    let rows = stored_ranges(&pool).await;
    assert_eq!(rows.len(), 1, "only GitHub is in use: {rows:?}");
    let kept = &rows[0];
    assert_eq!(
        (kept.provider.as_str(), kept.source_url.as_str()),
        ("github", url.as_str())
    );
    assert_eq!(
        kept.cidrs.as_deref(),
        Some(&["192.0.2.0/24".to_owned(), "2001:db8::/32".to_owned()][..])
    );
    let first_read = kept.fetched_at.unwrap();
    assert!(
        first_read >= before - chrono::TimeDelta::seconds(1),
        "{first_read} {before}"
    );
    assert_eq!((kept.failures, kept.last_error.as_deref()), (0, None));
    let run: (String, String, serde_json::Value) = sqlx::query_as(
        "SELECT status, trigger, found FROM maintenance_runs WHERE job = 'address_ranges' ORDER BY run_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((run.0.as_str(), run.1.as_str()), ("completed", "test"));
    assert_eq!(run.2["fetched"], 1);

    // Not due yet (read within the refresh interval): left alone, even though it changed.
    set_answer(&github_list, 200, r#"{"hooks":["203.0.113.0/24"]}"#);
    let scheduled = refresher(&pool, &url, Duration::from_secs(3600))
        .run_once("schedule")
        .await
        .unwrap();
    let RangesRun::Completed { outcome, .. } = scheduled else {
        panic!("{scheduled:?}")
    };
    assert_eq!((outcome.fetched, outcome.not_due), (0, 1));
    assert_eq!(stored_ranges(&pool).await[0].fetched_at, Some(first_read));

    // Due: the new list replaces the old one.
    assert_eq!(refresh(&pool, &url).await.fetched, 1);
    let replaced = &stored_ranges(&pool).await[0];
    assert_eq!(
        replaced.cidrs.as_deref(),
        Some(&["203.0.113.0/24".to_owned()][..])
    );
    assert!(replaced.fetched_at.unwrap() > first_read);

    // The stand-in fails: the list kept stays, and the failures are counted.
    set_answer(&github_list, 500, "{}");
    let failed = refresh(&pool, &url).await;
    assert_eq!(
        (failed.fetched, failed.failed.clone()),
        (0, vec!["github".to_owned()])
    );
    set_answer(&github_list, 200, r#"{"web":["198.51.100.0/24"]}"#);
    assert_eq!(refresh(&pool, &url).await.failed, vec!["github".to_owned()]);
    set_answer(&github_list, 200, r#"{"hooks":[]}"#);
    assert_eq!(refresh(&pool, &url).await.failed, vec!["github".to_owned()]);
    let kept = &stored_ranges(&pool).await[0];
    assert_eq!(kept.cidrs, replaced.cidrs);
    assert_eq!(kept.fetched_at, replaced.fetched_at);
    assert_eq!(kept.failures, 3);
    assert_eq!(kept.last_error.as_deref(), Some("the list is empty"));
    let report = address_ranges::report(&pool).await.unwrap();
    let github_report = report.iter().find(|p| p.provider == "github").unwrap();
    assert_eq!(
        (
            github_report.state.as_str(),
            github_report.ranges,
            github_report.failures
        ),
        ("fresh", 1, 3)
    );
    assert_eq!(github_report.sources, vec!["github (observe)".to_owned()]);
    let stripe_report = report.iter().find(|p| p.provider == "stripe").unwrap();
    assert_eq!(
        (stripe_report.state.as_str(), stripe_report.sources.len()),
        ("never read", 0)
    );

    // Read again once the provider answers: the failures are cleared.
    set_answer(&github_list, 200, GITHUB_HOOKS);
    assert_eq!(refresh(&pool, &url).await.fetched, 1);
    let recovered = &stored_ranges(&pool).await[0];
    assert_eq!(
        (recovered.failures, recovered.cidrs.as_ref().map(Vec::len)),
        (0, Some(2))
    );
}

/// A source that observes stores a signed delivery from outside its provider's ranges (200),
/// counts it, and the check breaches; one from inside is stored and not counted.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn observe_stores_a_delivery_from_outside_and_counts_it(pool: PgPool) {
    let github_list = answer(200, serde_json::from_str(GITHUB_HOOKS).unwrap());
    let app = app(&pool, &[github_source(None)]).await;
    refresh(&pool, &stand_in(&github_list).await).await;

    let inside = github("d-inside", 1);
    let reply = post(&app, &inside, "192.0.2.10").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    assert!(outside(&pool).await.is_empty());
    assert!(
        !breaches(&pool)
            .await
            .contains(&"addresses_outside_provider_ranges_last_day".to_owned())
    );
    assert_eq!(
        measured(&pool, "addresses_outside_provider_ranges_last_day").await,
        Some(0.0)
    );

    let from_outside = github("d-outside", 2);
    let reply = post(&app, &from_outside, "203.0.113.9").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    let stored = event(&pool, TENANT, "d-outside").await.expect("stored");
    assert_eq!(stored.payload.as_deref(), Some(&from_outside.body[..]));
    // The same address again: one row, counted twice.
    let again = github("d-outside-2", 3);
    assert_eq!(
        post(&app, &again, "203.0.113.9").await.status,
        StatusCode::OK
    );
    assert_eq!(
        outside(&pool).await,
        vec![Outside {
            source_address: "203.0.113.9".into(),
            admitted: 2,
            refused: 0,
        }]
    );
    assert_eq!(events(&pool).await.len(), 3);
    let refused: i64 = sqlx::query_scalar("SELECT count(*) FROM refused_deliveries")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(refused, 0, "observed, not refused");
    assert!(
        breaches(&pool)
            .await
            .contains(&"addresses_outside_provider_ranges_last_day".to_owned())
    );
    assert_eq!(
        measured(&pool, "addresses_outside_provider_ranges_last_day").await,
        Some(1.0)
    );

    // A forged delivery from outside is refused for its signature, and not counted as one
    // from the provider's secret.
    let mut forged = github("d-forged", 4);
    forged.body = br#"{"forged":true}"#.to_vec();
    assert_eq!(
        post(&app, &forged, "198.51.100.7").await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(outside(&pool).await.len(), 1);
}

/// A source that enforces refuses a signed delivery from outside with 403 before anything is
/// stored, keeps the refusal with its reason, and counts it; one from inside is stored. An
/// `X-Forwarded-For` naming an address inside changes nothing.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn enforce_refuses_a_delivery_from_outside_and_keeps_the_refusal(pool: PgPool) {
    let github_list = answer(200, serde_json::from_str(GITHUB_HOOKS).unwrap());
    let app = app(&pool, &[github_source(Some(AddressCheck::Enforce))]).await;
    refresh(&pool, &stand_in(&github_list).await).await;

    let mut from_outside = github("d-outside", 1);
    set(&mut from_outside.headers, "x-forwarded-for", "192.0.2.10");
    let reply = post(&app, &from_outside, "203.0.113.9").await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert_eq!(reply.json, json!({"error": "address not allowed"}));
    assert!(events(&pool).await.is_empty(), "nothing stored");
    let kept: Vec<(i16, String, String, String)> = sqlx::query_as(
        "SELECT status, reason, check_failed, detail FROM refused_deliveries WHERE source_id = 'github'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let (status, reason, check, detail) = &kept[0];
    assert_eq!(
        (*status, reason.as_str(), check.as_str()),
        (403, "address", "outside_provider_ranges")
    );
    assert!(
        detail.contains("203.0.113.9") && detail.contains("github"),
        "{detail}"
    );
    assert_eq!(
        outside(&pool).await,
        vec![Outside {
            source_address: "203.0.113.9".into(),
            admitted: 0,
            refused: 1,
        }]
    );
    assert!(
        breaches(&pool)
            .await
            .contains(&"addresses_outside_provider_ranges_last_day".to_owned())
    );

    let inside = github("d-inside", 2);
    let reply = post(&app, &inside, "192.0.2.10").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    assert!(event(&pool, TENANT, "d-inside").await.is_some());

    // No source address at all (a request context without one): refused, failing closed.
    let unknown = github("d-unknown", 3);
    let reply = post_to(
        &app.ingestor,
        "github",
        unknown.headers.clone(),
        &unknown.body,
    )
    .await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert!(event(&pool, TENANT, "d-unknown").await.is_none());
}

/// A list never read, or older than the staleness limit, refuses nothing even under enforce:
/// the delivery from outside is stored, and the staleness is reported (the check breaches,
/// `hookctl providers ranges` says so). Read again, the list refuses once more.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_stale_or_never_read_list_refuses_nothing_and_is_reported(pool: PgPool) {
    let github_list = answer(500, json!({}));
    let url = stand_in(&github_list).await;
    let app = app(&pool, &[github_source(Some(AddressCheck::Enforce))]).await;

    // Never read (the pass tried, and the provider failed).
    assert_eq!(refresh(&pool, &url).await.failed, vec!["github".to_owned()]);
    let reply = post(&app, &github("d-1", 1), "203.0.113.9").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    assert!(
        breaches(&pool)
            .await
            .contains(&"provider_ranges_stale".to_owned())
    );
    let report = address_ranges::report(&pool).await.unwrap();
    let github_report = report.iter().find(|p| p.provider == "github").unwrap();
    assert_eq!(github_report.state, "never read");

    // Read: it refuses, and the check is quiet.
    set_answer(&github_list, 200, GITHUB_HOOKS);
    refresh(&pool, &url).await;
    assert_eq!(
        post(&app, &github("d-2", 2), "203.0.113.9").await.status,
        StatusCode::FORBIDDEN
    );
    assert!(
        !breaches(&pool)
            .await
            .contains(&"provider_ranges_stale".to_owned())
    );

    // Older than the limit: admitted again, and reported.
    sqlx::query(
        "UPDATE provider_address_ranges SET fetched_at = now() - make_interval(secs => $1)",
    )
    .bind(address_ranges::STALE_AFTER.as_secs_f64() + 60.0)
    .execute(&pool)
    .await
    .unwrap();
    let reply = post(&app, &github("d-3", 3), "203.0.113.9").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    assert!(event(&pool, TENANT, "d-3").await.is_some());
    assert!(
        breaches(&pool)
            .await
            .contains(&"provider_ranges_stale".to_owned())
    );
    let report = address_ranges::report(&pool).await.unwrap();
    let github_report = report.iter().find(|p| p.provider == "github").unwrap();
    assert_eq!(github_report.state, "stale");
    // Judged by nothing, it counted nothing either.
    assert_eq!(outside(&pool).await.len(), 1, "only d-2's refusal");

    // A source that stops checking takes its provider out of the stale count.
    sources::apply(&pool, &[github_source(Some(AddressCheck::Off))])
        .await
        .unwrap();
    assert!(
        !breaches(&pool)
            .await
            .contains(&"provider_ranges_stale".to_owned())
    );
}

/// IPv6 source addresses are judged as IPv4 ones are: inside a v6 range admitted, outside
/// refused; an IPv4 address written as IPv6 is read as the IPv4 one.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn ipv6_addresses_are_judged_against_ipv6_ranges(pool: PgPool) {
    let github_list = answer(200, serde_json::from_str(GITHUB_HOOKS).unwrap());
    let app = app(&pool, &[github_source(Some(AddressCheck::Enforce))]).await;
    refresh(&pool, &stand_in(&github_list).await).await;

    let reply = post(&app, &github("d-v6-in", 1), "2001:db8:1::5").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    let reply = post(&app, &github("d-v6-out", 2), "2001:db9::1").await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    let reply = post(&app, &github("d-mapped", 3), "::ffff:192.0.2.77").await;
    assert_eq!(
        (reply.status, reply.outcome()),
        (StatusCode::OK, "accepted")
    );
    let ids: Vec<String> = events(&pool)
        .await
        .into_iter()
        .map(|e| e.external_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&"d-v6-in".to_owned()) && ids.contains(&"d-mapped".to_owned()));
    assert_eq!(
        outside(&pool).await,
        vec![Outside {
            source_address: "2001:db9::1".into(),
            admitted: 0,
            refused: 1,
        }]
    );
}

/// The local runner hands ingest the TCP peer as the source address: the same signed delivery
/// is stored from 127.0.0.1 (inside) and refused from 127.0.0.2 (outside), whatever
/// `X-Forwarded-For` says.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_local_runner_checks_the_tcp_peer(pool: PgPool) {
    let github_list = answer(200, json!({"hooks": ["127.0.0.1/32"]}));
    let app = app(&pool, &[github_source(Some(AddressCheck::Enforce))]).await;
    refresh(&pool, &stand_in(&github_list).await).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let runner = hookctl::serve::Runner {
        ingestor: Arc::clone(&app.ingestor),
        registry: Arc::new(shared::effects::EffectRegistry::standard()),
        buffer: None,
    };
    tokio::spawn(hookctl::serve::serve(
        listener,
        hookctl::serve::router(runner, MAX_BODY),
    ));
    let send = |from: &str, d: Delivery| {
        let client = reqwest::Client::builder()
            .local_address(from.parse::<std::net::IpAddr>().unwrap())
            .build()
            .unwrap();
        let mut headers = d.headers;
        set(&mut headers, "x-forwarded-for", "127.0.0.1");
        async move {
            client
                .post(format!("http://{address}/webhooks/github"))
                .headers(headers)
                .body(d.body)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(send("127.0.0.2", github("d-far", 1)).await, 403);
    assert_eq!(send("127.0.0.1", github("d-near", 2)).await, 200);
    assert!(event(&pool, TENANT, "d-near").await.is_some());
    assert!(event(&pool, TENANT, "d-far").await.is_none());
    assert_eq!(
        outside(&pool).await,
        vec![Outside {
            source_address: "127.0.0.2".into(),
            admitted: 0,
            refused: 1,
        }]
    );
}
