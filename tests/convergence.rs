//! (a) Processing order is not arrival order: any permutation of an entity's version sequence,
//! with random duplicate deliveries, converges to the highest version. A property test with
//! shrinking, each case delivered through ingest and drained after every delivery against a
//! real PostgreSQL (one database for the run, created and dropped here).

use std::time::Duration;

use pipeline_tests::drain::*;
use pipeline_tests::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Executor};

/// Versions 1..=n, each at least once, plus up to five duplicates, in any order.
fn delivery_orders() -> impl Strategy<Value = Vec<i64>> {
    (1i64..=7)
        .prop_flat_map(|n| (Just(n), proptest::collection::vec(1..=n, 0..=5)))
        .prop_flat_map(|(n, dups)| Just((1..=n).chain(dups).collect::<Vec<_>>()).prop_shuffle())
}

#[test]
fn any_order_with_duplicates_converges_to_the_highest_version() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL is not set: run scripts/test");
    let admin: PgConnectOptions = url.parse().unwrap();
    let name = format!("convergence_{}_{}", std::process::id(), now());
    let (app, drainer) = rt.block_on(async {
        let mut conn = admin.connect().await.unwrap();
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(admin.clone().database(&name))
            .await
            .unwrap();
        shared::store::MIGRATOR.run(&pool).await.unwrap();
        let app = app(pool.clone()).await;
        let drainer = standard_drainer(&pool);
        (app, drainer)
    });

    let case = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let result = runner.run(&delivery_orders(), |order| {
        let entity = format!("prop-{}", case.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        rt.block_on(async {
            let mut announced = 0;
            let mut highest = 0;
            for &version in &order {
                let d = entity_event(&format!("{entity}-v{version}"), &entity, version, "item.updated");
                let reply = app.post(ENTITIES, d.headers, &d.body).await;
                prop_assert_eq!(reply.status, 200);
                drain_all(&drainer, &app.pool, Duration::from_secs(10)).await;
                if version > highest && reply.outcome() == "accepted" {
                    highest = version;
                    announced += 1;
                }
            }
            let (version, state_version, last_event): (i64, i64, String) = sqlx::query_as(
                "SELECT version, (state -> 'data' ->> 'version')::bigint, last_event_id FROM entities WHERE entity_id = $1",
            )
            .bind(&entity)
            .fetch_one(&app.pool)
            .await
            .unwrap();
            let max = *order.iter().max().unwrap();
            prop_assert_eq!((version, state_version, last_event), (max, max, format!("{entity}-v{max}")), "order {:?}", order);
            let outbox: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE payload ->> 'entity_id' = $1")
                .bind(&entity)
                .fetch_one(&app.pool)
                .await
                .unwrap();
            prop_assert_eq!(outbox, announced, "one announcement per version that raised the state, order {:?}", order);
            Ok::<(), TestCaseError>(())
        })
    });

    rt.block_on(async {
        app.pool.close().await;
        let mut conn = admin.connect().await.unwrap();
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {name} WITH (FORCE)"
        )))
        .await
        .unwrap();
    });
    result.unwrap();
}
