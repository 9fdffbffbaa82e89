//! Stale-if-error: a warm ingest keeps verifying with its last-known sources and secrets while
//! the database or Secrets Manager cannot answer, for a bounded time, and asks again at most
//! once a second meanwhile.
//!
//! The outage is real: the registry's pool (or the Secrets Manager client) talks through a TCP
//! proxy the test takes down. Down, the proxy cuts every open connection and accepts new ones
//! without ever answering (as a failed-over host's address does), counting them: each is one
//! attempt to reach the store. Time past the TTL and the bound is a clock the test moves.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline_tests::*;
use shared::domain::{Scheme, SourceId};
use shared::secrets::{AwsSecrets, AwsSecretsSettings, Clock, SecretError, SecretStore};
use shared::sources::{self, SourceRegistry};
use shared::stale::{REFRESH_TIMEOUT, RETRY_INTERVAL};
use shared::store;
use sqlx::PgPool;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A clock the test moves.
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

/// A TCP proxy to `target` that the test can take down and bring back.
struct Proxy {
    address: SocketAddr,
    state: Arc<ProxyState>,
    accept: AbortHandle,
}

#[derive(Default)]
struct ProxyState {
    down: AtomicBool,
    /// Down, and new connections are closed at once rather than held.
    refusing: AtomicBool,
    /// Connections accepted while down: attempts to reach the store.
    attempts: AtomicUsize,
    forwarding: Mutex<Vec<AbortHandle>>,
    held: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState::default());
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if shared.down.load(Ordering::SeqCst) {
                    shared.attempts.fetch_add(1, Ordering::SeqCst);
                    if !shared.refusing.load(Ordering::SeqCst) {
                        shared.held.lock().unwrap().push(client);
                    }
                    continue;
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                shared.forwarding.lock().unwrap().push(task.abort_handle());
            }
        })
        .abort_handle();
        Self {
            address,
            state,
            accept,
        }
    }

    /// Cuts every connection; new ones are accepted and never answered.
    fn down(&self) {
        self.state.down.store(true, Ordering::SeqCst);
        for task in self.state.forwarding.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Down, and new connections are closed as soon as they are accepted (an HTTP client
    /// without a read timeout would wait on a held one for ever).
    fn refuse(&self) {
        self.state.refusing.store(true, Ordering::SeqCst);
        self.down();
        self.state.held.lock().unwrap().clear();
    }

    /// Forwards again; the connections held while down are closed.
    fn up(&self) {
        self.state.down.store(false, Ordering::SeqCst);
        self.state.refusing.store(false, Ordering::SeqCst);
        self.state.held.lock().unwrap().clear();
    }

    fn attempts(&self) -> usize {
        self.state.attempts.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.down();
    }
}

const TTL: Duration = Duration::from_secs(30);
const STALE_IF_ERROR: Duration = Duration::from_secs(600);

/// A registry reading `pool`'s database through a proxy, on the test's clock.
async fn registry_through_proxy(pool: &PgPool, clock: &TestClock) -> (Arc<SourceRegistry>, Proxy) {
    let options = (*pool.connect_options()).clone();
    let target: SocketAddr = format!("{}:{}", options.get_host(), options.get_port())
        .parse()
        .expect("the test database is at an IP address");
    let proxy = Proxy::start(target).await;
    let through = options
        .host(&proxy.address.ip().to_string())
        .port(proxy.address.port());
    let proxied = store::lazy_pool(
        through,
        &store::PoolSettings {
            max_connections: 2,
            acquire_timeout: Duration::from_secs(1),
        },
    );
    let registry = SourceRegistry::new(proxied, TTL)
        .with_stale_if_error(STALE_IF_ERROR)
        .with_clock(clock.clock());
    (Arc::new(registry), proxy)
}

fn id(raw: &str) -> SourceId {
    SourceId::parse(raw).unwrap()
}

async fn stored_sources(pool: &PgPool, ids: &[&str]) {
    let list: Vec<_> = ids
        .iter()
        .map(|i| source(i, TENANT, Scheme::Stripe, &format!("secret/{i}")))
        .collect();
    sources::apply(pool, &list).await.unwrap();
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_known_source_is_served_stale_within_the_bound_and_refused_after(pool: PgPool) {
    stored_sources(&pool, &["stripe"]).await;
    let clock = TestClock::new();
    let (registry, proxy) = registry_through_proxy(&pool, &clock).await;
    let warm = registry.get(&id("stripe")).await.unwrap().unwrap();
    assert_eq!(warm.tenant_id.as_str(), TENANT);

    proxy.down();
    // Past its TTL, the database unreachable: the last-known source.
    clock.advance(TTL + Duration::from_secs(1));
    let stale = registry.get(&id("stripe")).await.unwrap();
    assert_eq!(stale.as_deref(), Some(&*warm));
    // Still at the last moment of the bound.
    clock.advance(STALE_IF_ERROR - Duration::from_secs(2));
    assert_eq!(
        registry.get(&id("stripe")).await.unwrap().as_deref(),
        Some(&*warm)
    );
    // Past it: the database's error, retryable (ingest answers 503).
    clock.advance(Duration::from_secs(2));
    let error = registry.get(&id("stripe")).await.unwrap_err();
    assert!(error.is_retryable(), "{error}");
    // A source this process never read cannot be served at all.
    stored_sources(&pool, &["never_read"]).await;
    assert!(registry.get(&id("never_read")).await.is_err());

    // Back: read afresh.
    proxy.up();
    clock.advance(RETRY_INTERVAL);
    assert_eq!(
        registry.get(&id("stripe")).await.unwrap().as_deref(),
        Some(&*warm)
    );
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_source_disabled_or_deleted_during_the_outage_is_refused_once_the_database_answers(
    pool: PgPool,
) {
    stored_sources(&pool, &["kept", "disabled", "deleted"]).await;
    let clock = TestClock::new();
    let (registry, proxy) = registry_through_proxy(&pool, &clock).await;
    for s in ["kept", "disabled", "deleted"] {
        assert!(registry.get(&id(s)).await.unwrap().is_some());
    }

    proxy.down();
    clock.advance(TTL + Duration::from_secs(1));
    for s in ["kept", "disabled", "deleted"] {
        assert!(registry.get(&id(s)).await.unwrap().is_some(), "{s} stale");
    }
    // Changed while this process cannot see the database.
    let mut disabled = source("disabled", TENANT, Scheme::Stripe, "secret/disabled");
    disabled.enabled = false;
    sources::apply(&pool, &[disabled]).await.unwrap();
    sqlx::query("DELETE FROM sources WHERE source_id = 'deleted'")
        .execute(&pool)
        .await
        .unwrap();

    proxy.up();
    clock.advance(RETRY_INTERVAL);
    assert!(registry.get(&id("kept")).await.unwrap().is_some());
    assert!(registry.get(&id("disabled")).await.unwrap().is_none());
    assert!(registry.get(&id("deleted")).await.unwrap().is_none());
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_error_that_will_not_pass_is_never_answered_stale(pool: PgPool) {
    stored_sources(&pool, &["stripe"]).await;
    let clock = TestClock::new();
    let (registry, _proxy) = registry_through_proxy(&pool, &clock).await;
    assert!(registry.get(&id("stripe")).await.unwrap().is_some());

    // The row no longer makes a source: a fault to fix, not an outage to ride out.
    sqlx::query("UPDATE sources SET external_id_from = 'not a locator' WHERE source_id = 'stripe'")
        .execute(&pool)
        .await
        .unwrap();
    clock.advance(TTL + Duration::from_secs(1));
    let error = registry.get(&id("stripe")).await.unwrap_err();
    assert!(!error.is_retryable(), "{error}");
    // And the cached copy is gone: the next lookup asks again (and fails again).
    assert!(registry.get(&id("stripe")).await.is_err());
}

/// A flood during the outage: the first lookup past the TTL asks (and waits at most
/// [`REFRESH_TIMEOUT`]); every other lookup is answered from the cache at once; the database is
/// asked again only after [`RETRY_INTERVAL`].
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_flood_during_the_outage_makes_a_bounded_number_of_database_attempts(pool: PgPool) {
    stored_sources(&pool, &["stripe"]).await;
    let clock = TestClock::new();
    let (registry, proxy) = registry_through_proxy(&pool, &clock).await;
    assert!(registry.get(&id("stripe")).await.unwrap().is_some());

    proxy.down();
    clock.advance(TTL + Duration::from_secs(1));
    let started = Instant::now();
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..200 {
        let registry = registry.clone();
        flood.spawn(async move { registry.get(&id("stripe")).await });
    }
    while let Some(result) = flood.join_next().await {
        assert!(result.unwrap().unwrap().is_some());
    }
    for _ in 0..200 {
        assert!(registry.get(&id("stripe")).await.unwrap().is_some());
    }
    let took = started.elapsed();
    assert!(
        took < REFRESH_TIMEOUT + Duration::from_millis(800),
        "400 lookups took {took:?}: more than the one bounded attempt"
    );
    let attempts = proxy.attempts();
    assert!(
        attempts <= 1,
        "{attempts} connection attempts for 400 lookups"
    );

    // A second later (on the cache's clock), one more attempt, and still served.
    clock.advance(RETRY_INTERVAL);
    for _ in 0..100 {
        assert!(registry.get(&id("stripe")).await.unwrap().is_some());
    }
    let attempts = proxy.attempts();
    assert!(
        attempts <= 2,
        "{attempts} connection attempts after one retry interval"
    );
}

// ---- Secrets Manager -----------------------------------------------------------------------

/// A Secrets Manager client on moto through a proxy, on the test's clock.
async fn secrets_through_proxy(clock: &TestClock, ttl: Duration) -> (SecretStore, Proxy) {
    let moto = url::Url::parse(&moto_endpoint()).unwrap();
    let target: SocketAddr = format!(
        "{}:{}",
        moto.host_str().unwrap(),
        moto.port_or_known_default().unwrap()
    )
    .parse()
    .expect("moto is at an IP address");
    let proxy = Proxy::start(target).await;
    let secrets = AwsSecrets::with_clock(
        &AwsSecretsSettings {
            endpoint_url: Some(format!("http://{}", proxy.address)),
            region: Some("us-east-1".into()),
            ttl,
        },
        clock.clock(),
    )
    .await
    .with_stale_if_error(STALE_IF_ERROR);
    (SecretStore::Aws(secrets), proxy)
}

#[tokio::test]
async fn a_secret_is_served_stale_within_the_bound_and_asked_for_at_most_once_a_second() {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stale", "whsec_known").await;
    let clock = TestClock::new();
    let (secrets, proxy) = secrets_through_proxy(&clock, TTL).await;
    assert_eq!(
        secrets.secrets(&name).await.unwrap().current.expose(),
        "whsec_known"
    );

    proxy.down();
    clock.advance(TTL + Duration::from_secs(1));
    let started = Instant::now();
    for _ in 0..200 {
        assert_eq!(
            secrets.secrets(&name).await.unwrap().current.expose(),
            "whsec_known"
        );
    }
    let took = started.elapsed();
    assert!(
        took < REFRESH_TIMEOUT + Duration::from_millis(800),
        "200 lookups took {took:?}"
    );
    // One GetSecretValue attempt (the SDK may open a connection per try of it).
    let first = proxy.attempts();
    assert!(first <= 3, "{first} connections for 200 lookups");
    clock.advance(RETRY_INTERVAL);
    for _ in 0..100 {
        assert!(secrets.secrets(&name).await.is_ok());
    }
    let second = proxy.attempts();
    assert!(
        second <= first + 3,
        "{second} connections after one retry interval"
    );

    // Past the bound: unavailable, never the old value.
    proxy.refuse();
    clock.advance(STALE_IF_ERROR);
    assert!(matches!(
        secrets.secrets(&name).await,
        Err(SecretError::Unavailable { .. })
    ));

    // Back, and the secret was deleted meanwhile: refused, not served stale.
    proxy.up();
    admin
        .delete_secret()
        .secret_id(&name)
        .force_delete_without_recovery(true)
        .send()
        .await
        .unwrap();
    clock.advance(RETRY_INTERVAL);
    assert!(matches!(
        secrets.secrets(&name).await,
        Err(SecretError::NotFound { .. })
    ));
}

#[tokio::test]
async fn a_rotation_made_during_the_outage_is_picked_up_once_secrets_manager_answers() {
    let admin = admin_client(&moto_endpoint()).await;
    let name = new_secret(&admin, "webhooks/stale", "whsec_before").await;
    let clock = TestClock::new();
    let (secrets, proxy) = secrets_through_proxy(&clock, TTL).await;
    assert!(secrets.secrets(&name).await.is_ok());

    proxy.down();
    clock.advance(TTL + Duration::from_secs(1));
    admin
        .put_secret_value()
        .secret_id(&name)
        .secret_string("whsec_after")
        .send()
        .await
        .unwrap();
    assert_eq!(
        secrets.secrets(&name).await.unwrap().current.expose(),
        "whsec_before",
        "stale while down"
    );
    proxy.up();
    clock.advance(RETRY_INTERVAL);
    let set = secrets.secrets(&name).await.unwrap();
    assert_eq!(set.current.expose(), "whsec_after");
    assert_eq!(set.previous.as_ref().unwrap().expose(), "whsec_before");
}
