//! `hookctl console` as an operator and an attacker meet it: served on a loopback port against a
//! real database, asked over HTTP (who may ask, what it answers), and driven in a real headless
//! Chromium through WebDriver (`chromedriver`, which the test command installs from Debian's
//! packages): the overview shows a breach the test caused, a search by provider id finds an
//! event, a group of dead letters is replayed from the page. The browser test writes each
//! screen to `docs/console/`.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use hookctl::backend::Backend;
use hookctl::console::{self, ConsoleOptions};
use serde_json::{Value, json};
use shared::ingest::{IngestLimits, Ingestor};
use shared::secrets::{SecretSet, SecretStore};
use shared::sources::SourceRegistry;
use sqlx::PgPool;

const SECRET: &str = "whsec_console";

/// A Stripe source `pay` of tenant `acme`, and events delivered to it through ingest.
struct Shop {
    pool: PgPool,
    ingestor: Ingestor,
}

impl Shop {
    async fn new(pool: PgPool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sources.toml");
        std::fs::write(
            &file,
            "[[source]]\nid = 'pay'\ntenant = 'acme'\nscheme = 'stripe'\nsecret_ref = 'local/pay'\n\
             [source.fields]\nentity_version = 'json:/data/object/version'\n",
        )
        .unwrap();
        let sources = shared::sources::read_sources_file(&file).unwrap();
        shared::sources::apply(&pool, &sources).await.unwrap();
        let ingestor = Ingestor::new(
            pool.clone(),
            Arc::new(SourceRegistry::new(pool.clone(), Duration::from_secs(30))),
            Arc::new(SecretStore::memory([(
                "local/pay".to_owned(),
                SecretSet::new(SECRET, None),
            )])),
            IngestLimits {
                max_body_bytes: 64 * 1024,
            },
        );
        Shop { pool, ingestor }
    }

    async fn deliver(&self, id: &str, customer: &str) {
        let body = serde_json::to_vec(&json!({
            "id": id, "object": "event", "type": "customer.updated",
            "data": {"object": {"id": customer, "object": "customer"}}
        }))
        .unwrap();
        support::post_stripe(&self.ingestor, "pay", SECRET, id, &body)
            .await
            .unwrap();
    }

    /// Event `id` changing customer `customer` to `version`.
    async fn deliver_version(&self, id: &str, customer: &str, version: i64) {
        let body = serde_json::to_vec(&json!({
            "id": id, "object": "event", "type": "customer.updated",
            "data": {"object": {"id": customer, "object": "customer", "version": version}}
        }))
        .unwrap();
        support::post_stripe(&self.ingestor, "pay", SECRET, id, &body)
            .await
            .unwrap();
    }

    /// Drains the queue as the drain function does, until it is empty.
    async fn drain(&self) {
        let drainer = shared::drain::Drainer::new(
            self.pool.clone(),
            Arc::new(shared::effects::EffectRegistry::standard()),
            Default::default(),
        );
        while drainer.run_once().await.unwrap().claimed > 0 {}
    }

    /// A request for `id` signed with a secret the source does not hold: refused (401), and
    /// kept as a refusal.
    async fn forge(&self, id: &str) {
        let body =
            serde_json::to_vec(&json!({"id": id, "object": "event", "type": "customer.updated"}))
                .unwrap();
        let refused = support::post_stripe(&self.ingestor, "pay", "whsec_guessed", id, &body).await;
        assert!(refused.is_err(), "{refused:?}");
    }

    /// Moves a stored event to the dead letters, as the drain does when it gives up.
    async fn dead_letter(&self, id: &str, error: &str) {
        sqlx::query(
            "WITH q AS (DELETE FROM event_queue WHERE external_id = $1 RETURNING tenant_id), \
                  e AS (UPDATE webhook_events SET status = 'dead_lettered', attempts = 8 \
                        WHERE external_id = $1 RETURNING *) \
             INSERT INTO dead_letters (tenant_id, external_id, source_id, event_type, payload, \
                 headers, error, reason, attempts) \
             SELECT tenant_id, external_id, source_id, event_type, payload, headers, $2, \
                 'exhausted', attempts FROM e",
        )
        .bind(id)
        .bind(error)
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

/// A console on a free loopback port; its URL (with the one-time token) and port.
async fn start(pool: &PgPool, write: bool) -> (String, u16) {
    start_with(Backend::direct(pool.clone()), write).await
}

async fn start_with(backend: Backend, write: bool) -> (String, u16) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = listener.local_addr().unwrap();
    let (console, url) = console::console(
        backend,
        ConsoleOptions {
            write,
            actor: "alice".into(),
        },
        local,
    );
    tokio::spawn(console::serve(listener, console));
    (url, local.port())
}

fn token_of(url: &str) -> String {
    url.split_once("token=").unwrap().1.to_owned()
}

/// A page's HTTP client: it keeps the session cookie the console sets, as a browser does.
#[derive(Default)]
struct Page {
    http: reqwest::Client,
    cookie: std::sync::Mutex<Option<String>>,
}

fn client() -> Page {
    Page::default()
}

impl Page {
    fn with_cookie(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.cookie.lock().unwrap().clone() {
            Some(cookie) => request.header("cookie", cookie),
            None => request,
        }
    }
}

async fn operate(page: &Page, port: u16, origin: Option<&str>, request: Value) -> (u16, Value) {
    let mut call = page.with_cookie(
        page.http
            .post(format!("http://127.0.0.1:{port}/api/operator"))
            .json(&request),
    );
    if let Some(origin) = origin {
        call = call.header("origin", origin);
    }
    let response = call.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Offers the one-time token; keeps the cookie it opens. Returns the status.
async fn open_session(page: &Page, port: u16, token: &str) -> u16 {
    let response = page
        .http
        .post(format!("http://127.0.0.1:{port}/session"))
        .json(&json!({ "token": token }))
        .send()
        .await
        .unwrap();
    if let Some(set) = response.headers().get("set-cookie") {
        let set = set.to_str().unwrap();
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        *page.cookie.lock().unwrap() = set.split(';').next().map(str::to_owned);
    }
    response.status().as_u16()
}

/// Only a page on this machine, opened by the person who started the console, gets answers:
/// another `Host` (a rebound DNS name) is refused, the API needs the session that the
/// one-time token opens, and the token opens one session only.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_console_answers_only_its_own_page_on_loopback(pool: PgPool) {
    let (url, port) = start(&pool, false).await;
    assert!(url.starts_with(&format!("http://127.0.0.1:{port}/#token=")));
    let page = client();

    let rebound = page
        .http
        .get(format!("http://127.0.0.1:{port}/"))
        .header("host", format!("console.attacker.example:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status().as_u16(), 403);
    let shell = page
        .http
        .get(format!("http://localhost:{port}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(shell.status().as_u16(), 200);
    assert!(shell.text().await.unwrap().contains("hookctl console"));

    let (status, _) = operate(&page, port, None, json!({"action": "status"})).await;
    assert_eq!(status, 401, "no session, no answer");
    assert_eq!(open_session(&page, port, "00").await, 401);
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let (status, answer) = operate(&page, port, None, json!({"action": "status"})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["verdict"], "accounted_for");

    // The link works once: a second browser with the same URL gets nothing.
    let other = client();
    assert_eq!(open_session(&other, port, &token_of(&url)).await, 401);
    let (status, _) = operate(&other, port, None, json!({"action": "status"})).await;
    assert_eq!(status, 401);
}

/// A change is answered only by a console started with `--write`, only from its own origin,
/// only with a reason; it is recorded as the console's actor whatever the page says.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_change_needs_write_its_own_origin_and_a_reason(pool: PgPool) {
    let shop = Shop::new(pool.clone()).await;
    shop.deliver("evt_1", "cus_1").await;
    shop.dead_letter("evt_1", "retryable: upstream timeout")
        .await;
    let replay = json!({"action": "replay", "filter": {"ids": [1]}, "reason": "upstream is back",
                        "actor": "mallory"});

    let (url, port) = start(&pool, false).await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let own = format!("http://127.0.0.1:{port}");
    let (status, answer) = operate(&page, port, Some(&own), replay.clone()).await;
    assert_eq!(status, 403, "read-only: {answer}");

    let (url, port) = start(&pool, true).await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let own = format!("http://127.0.0.1:{port}");
    let (status, _) = operate(&page, port, None, replay.clone()).await;
    assert_eq!(status, 403, "no Origin");
    let (status, _) = operate(
        &page,
        port,
        Some("http://console.attacker.example"),
        replay.clone(),
    )
    .await;
    assert_eq!(status, 403, "another origin");
    let mut no_reason = replay.clone();
    no_reason["reason"] = json!("  ");
    let (status, _) = operate(&page, port, Some(&own), no_reason).await;
    assert_eq!(status, 400);
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE status = 'new'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(open, 1, "nothing refused changed anything");

    let (status, answer) = operate(&page, port, Some(&own), replay).await;
    assert_eq!(status, 200, "{answer}");
    let (actor, reason): (String, String) = sqlx::query_as(
        "SELECT actor, reason FROM operator_actions ORDER BY action_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (actor.as_str(), reason.as_str()),
        ("alice", "upstream is back")
    );
    let replayed: String =
        sqlx::query_scalar("SELECT status FROM dead_letters WHERE external_id = 'evt_1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(replayed, "replayed");

    // The event's page reads its story from event_history.
    let (status, story) = operate(
        &page,
        port,
        None,
        json!({"action": "event_history", "tenant_id": "acme", "external_id": "evt_1"}),
    )
    .await;
    assert_eq!(status, 200, "{story}");
    let letters = &story["history"]["dead_letters"];
    assert_eq!(letters.as_array().unwrap().len(), 1, "{story}");
    assert_eq!(letters[0]["status"], "replayed");
    assert_eq!(letters[0]["replay_count"], 1);
    assert_eq!(story["history"]["filing"]["verified_with"], "current");
    assert!(
        story["history"]["queued"].is_null(),
        "processed: not queued"
    );
}

/// The events page's search: by provider id, by source and type, by what the payload
/// contains, newest first, a page at a time with the cursor the answer gives.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn events_are_found_by_provider_id_payload_and_page(pool: PgPool) {
    let shop = Shop::new(pool.clone()).await;
    for (id, customer) in [("evt_a", "cus_1"), ("evt_b", "cus_2"), ("evt_c", "cus_1")] {
        shop.deliver(id, customer).await;
    }
    let (url, port) = start(&pool, false).await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let ids = |answer: &Value| -> Vec<String> {
        answer["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["external_id"].as_str().unwrap().to_owned())
            .collect()
    };

    let (_, by_id) = operate(
        &page,
        port,
        None,
        json!({"action": "list_events", "search": {"external_id": "evt_b"}}),
    )
    .await;
    assert_eq!(ids(&by_id), ["evt_b"]);
    let (_, by_payload) = operate(
        &page,
        port,
        None,
        json!({"action": "list_events",
               "search": {"source_id": "pay", "event_type": "customer.updated",
                          "contains": {"data": {"object": {"id": "cus_1"}}}}}),
    )
    .await;
    assert_eq!(ids(&by_payload), ["evt_c", "evt_a"], "newest first");

    let (_, first) = operate(
        &page,
        port,
        None,
        json!({"action": "list_events", "limit": 2}),
    )
    .await;
    assert_eq!(ids(&first), ["evt_c", "evt_b"]);
    let after = first["next"].clone();
    assert!(after.is_object(), "a full page says where the next begins");
    let (_, second) = operate(
        &page,
        port,
        None,
        json!({"action": "list_events", "limit": 2, "search": {"after": after}}),
    )
    .await;
    assert_eq!(ids(&second), ["evt_a"]);
    assert!(second["next"].is_null());

    let (_, shown) = operate(
        &page,
        port,
        None,
        json!({"action": "show_event", "tenant_id": "acme", "external_id": "evt_b"}),
    )
    .await;
    assert_eq!(shown["data"]["data"]["object"]["id"], "cus_2");
}

/// A minimal WebDriver client over `chromedriver`'s HTTP API.
struct Browser {
    http: reqwest::Client,
    base: String,
    driver: std::process::Child,
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    async fn start() -> Browser {
        Self::start_with(&[]).await
    }

    /// A browser with more command-line arguments (`--host-resolver-rules=...`).
    async fn start_with(more: &[&str]) -> Browser {
        let chromedriver = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = std::process::Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{chromedriver}: {e}. The console's browser test needs Debian's chromium and \
                     chromium-driver; ./scripts/test installs them"
                )
            });
        let http = reqwest::Client::new();
        let root = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while http.get(format!("{root}/status")).send().await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let args: Vec<&str> = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
        ]
        .into_iter()
        .chain(more.iter().copied())
        .collect();
        let session: Value = http
            .post(format!("{root}/session"))
            .json(&json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": args}}}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = session["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {session}"))
            .to_owned();
        Browser {
            http,
            base: format!("{root}/session/{id}"),
            driver,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if !body.is_null() {
            request = request.json(&body);
        }
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        answer["value"].clone()
    }

    async fn go(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    /// The element `css` selects, once it exists (10 s at most).
    async fn find(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self
                .call(
                    reqwest::Method::POST,
                    "/element",
                    json!({"using": "css selector", "value": css}),
                )
                .await;
            if let Some(id) = found[ELEMENT].as_str() {
                return id.to_owned();
            }
            assert!(Instant::now() < deadline, "no element {css}: {found}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The text of the element `css` selects, once it contains `expected` (10 s at most).
    async fn text_containing(&self, css: &str, expected: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let id = self.find(css).await;
            let text = self
                .call(
                    reqwest::Method::GET,
                    &format!("/element/{id}/text"),
                    Value::Null,
                )
                .await;
            let text = text.as_str().unwrap_or_default().to_owned();
            if text.contains(expected) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "{css} says {text:?}, not {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            json!({}),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    async fn script(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            json!({"script": script, "args": []}),
        )
        .await
    }

    /// Runs `script` in the page with a callback as its last argument; what it passes back.
    async fn script_async(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/async",
            json!({"script": script, "args": []}),
        )
        .await
    }

    /// Writes the page as it stands to `docs/console/<name>.png`.
    async fn screenshot(&self, name: &str) {
        use base64::Engine as _;
        let png = self
            .call(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/console");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(format!("{dir}/{name}.png"), bytes).unwrap();
    }

    async fn quit(mut self) {
        self.call(reqwest::Method::DELETE, "", Value::Null).await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// The console in a real browser: the overview leads with the breach the test caused (a dead
/// letter), a search by the provider's id finds the event and its page shows its payload, the
/// dead letters' group is replayed from the page as a job (its estimate confirmed, its progress
/// shown to the end), recorded as the console's actor, and a
/// replayed event's page shows its dead letter and that it was processed; a forged request is
/// counted on the overview and read, on the refusals page, as not the provider's; the overview
/// charts the last 24 hours; the events page tails new events live; a check's page shows its
/// history over the anomaly runs.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_operator_finds_an_event_and_replays_dead_letters_in_a_browser(pool: PgPool) {
    let shop = Shop::new(pool.clone()).await;
    // Someone forges a request before the provider's own deliveries arrive.
    shop.forge("evt_forged").await;
    // A customer changed twice, both changes processed.
    shop.deliver_version("evt_v1", "cus_v", 1).await;
    shop.deliver_version("evt_v2", "cus_v", 2).await;
    shop.drain().await;
    for (id, customer) in [
        ("evt_ok", "cus_7"),
        ("evt_dl1", "cus_8"),
        ("evt_dl2", "cus_9"),
    ] {
        shop.deliver(id, customer).await;
    }
    shop.dead_letter("evt_dl1", "retryable: CRM timed out")
        .await;
    shop.dead_letter("evt_dl2", "retryable: CRM timed out")
        .await;
    // An event the provider's sequence says is missing.
    sqlx::query(
        "INSERT INTO gap_candidates (tenant_id, external_id, source_id) \
         VALUES ('acme', 'evt_missing', 'pay')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The anomaly run's rollup of the hours, which the overview's chart reads.
    shared::store::delivery_hours::roll(&pool).await.unwrap();
    let (url, _) = start(&pool, true).await;
    let browser = Browser::start().await;
    // A page of the console by its fragment, once the session is open.
    let page = |fragment: &str| format!("{}#{fragment}", url.split('#').next().unwrap());

    browser.go(&url).await;
    browser.text_containing("#verdict", "Needs attention").await;
    browser.text_containing("#open-dead-letters", "2").await;
    browser.text_containing("#sources", "pay").await;
    browser.text_containing("#mode", "recorded as alice").await;
    browser.text_containing("#refused-last-day", "1").await;
    // Per source: evt_ok waits in the queue (the dead letters do not), one gap is open.
    browser.text_containing("[data-pending=pay]", "1").await;
    browser.text_containing("[data-gaps=pay]", "1").await;
    browser.text_containing("[data-refused=pay]", "1").await;
    let bars = browser
        .script("return document.querySelectorAll('#sources svg rect').length;")
        .await;
    assert_eq!(bars, 24, "a bar for each of the last 24 hours");
    let now = browser
        .script("const bars = document.querySelectorAll('#sources svg rect title'); return bars[bars.length - 1].textContent;")
        .await;
    assert!(
        now.as_str().unwrap().contains(": 5 (usually unknown)"),
        "{now}"
    );
    browser.screenshot("overview").await;

    browser.click("#nav-events").await;
    browser.type_into("#search-id", "evt_ok").await;
    browser.click("#search-button").await;
    browser.text_containing("#events", "evt_ok").await;
    browser.screenshot("events").await;
    browser.click("#events a.event-link").await;
    browser.text_containing("#event-id", "evt_ok").await;
    browser.text_containing("#payload", "cus_7").await;
    browser
        .text_containing(
            "[data-fact='verified by']",
            "stripe, with the current secret",
        )
        .await;
    browser
        .text_containing("[data-fact='came through the SQS buffer']", "no")
        .await;
    browser
        .text_containing("#entity", "names the entity without a version")
        .await;
    browser.go(&page("/event/acme/evt_v2")).await;
    browser
        .text_containing("#entity", "Changed customer cus_v from version 1 to 2")
        .await;
    browser.screenshot("event").await;

    // The gap, fetched by the next backfill pass without waiting out its grace.
    browser.click("#nav-gaps").await;
    browser.text_containing("#gaps", "evt_missing").await;
    browser
        .script("window.prompt = () => 'CRM is back'; window.confirm = () => true;")
        .await;
    browser.click("#backfill-0").await;
    browser
        .text_containing("#action-outcome", "next_pass_within_seconds")
        .await;
    browser.text_containing("#gaps", "asked").await;
    browser.screenshot("gaps").await;

    browser.click("#nav-dead-letters").await;
    browser
        .text_containing("#dead-letters", "retryable: CRM timed out")
        .await;
    browser.screenshot("dead-letters").await;
    browser
        .script("window.prompt = () => 'CRM is back'; window.confirm = () => true;")
        .await;
    browser.click("#replay-group-0").await;
    browser
        .text_containing(
            "#job-status",
            "finished; 2 done, 0 failed again, 0 skipped, of 2 estimated",
        )
        .await;
    browser.screenshot("job").await;

    // A replayed event's page tells its story: dead-lettered once, replayed, processed.
    browser.go(&page("/event/acme/evt_dl1")).await;
    browser.text_containing("#letters", "replayed").await;
    browser
        .text_containing("#letters", "retryable: CRM timed out")
        .await;
    browser
        .text_containing("[data-fact=state]", "processed")
        .await;
    browser.screenshot("event-history").await;
    // The live tail: an event delivered while the page is open shows up on its own.
    browser.go(&page("/events?live=1")).await;
    browser.text_containing("#events-shown", "live").await;
    shop.deliver("evt_live", "cus_live").await;
    browser.text_containing("#events", "evt_live").await;

    browser.click("#nav-refused").await;
    browser
        .text_containing("#refused-summary", "no_match")
        .await;
    browser
        .text_containing("#refused-summary", "deliveries were stored meanwhile")
        .await;
    browser.screenshot("refused").await;
    // Two anomaly runs: the checks page, and one check's history.
    let settings = shared::anomaly::AnomalySettings::default();
    for _ in 0..2 {
        shared::anomaly::run_once(&pool, &settings, "test")
            .await
            .unwrap();
    }
    browser.click("#nav-checks").await;
    browser.text_containing("main", "measured").await;
    browser.click("#checks a.check-link").await;
    browser
        .text_containing("#check h2", "its last 2 run(s)")
        .await;
    browser.screenshot("check").await;
    browser.quit().await;

    let open = open_dead_letters(&pool).await.len();
    assert_eq!(open, 0, "the group was replayed whole");
    let processed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_events \
         WHERE external_id IN ('evt_dl1', 'evt_dl2') AND status = 'processed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(processed, 2, "both events processed by the replay");
    let queued: Vec<String> =
        sqlx::query_scalar("SELECT external_id FROM event_queue ORDER BY external_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        queued,
        ["evt_live", "evt_ok"],
        "only the events never dead-lettered wait for the drain; nothing replayed twice"
    );
    let (actor, reason): (String, String) = sqlx::query_as(
        "SELECT actor, reason FROM operator_actions ORDER BY action_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((actor.as_str(), reason.as_str()), ("alice", "CRM is back"));
    let (action, outcome): (String, Value) = sqlx::query_as(
        "SELECT action, outcome FROM operator_actions WHERE finished_at IS NOT NULL \
         ORDER BY action_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(action, "replay");
    assert_eq!(
        (&outcome["replayed"], &outcome["status"]),
        (&json!(2), &json!("finished")),
        "the job's record holds its counts: {outcome}"
    );
}

/// A job over everything a filter matches: estimated first, started from the page (the console
/// runs it server-side, a step at a time), read to the end; its record holds its counts. A job
/// aborted before its first step takes nothing.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_job_replays_what_a_filter_matches_and_an_abort_stops_it(pool: PgPool) {
    let shop = Shop::new(pool.clone()).await;
    for id in ["evt_x1", "evt_x2", "evt_x3", "evt_y1"] {
        shop.deliver(id, "cus_1").await;
    }
    for id in ["evt_x1", "evt_x2", "evt_x3"] {
        shop.dead_letter(id, "retryable: X timed out").await;
    }
    shop.dead_letter("evt_y1", "fatal: Y refused").await;
    let (url, port) = start(&pool, true).await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let own = format!("http://127.0.0.1:{port}");
    let filter = json!({"error_contains": "x timed"});

    let (_, estimate) = operate(
        &page,
        port,
        None,
        json!({"action": "estimate_job", "kind": "replay_dead_letters", "filter": filter}),
    )
    .await;
    assert_eq!(estimate["estimate"], 3);
    let (status, started) = operate(
        &page,
        port,
        Some(&own),
        json!({"action": "start_job", "kind": "replay_dead_letters", "filter": filter,
               "reason": "X is back"}),
    )
    .await;
    assert_eq!(status, 200, "{started}");
    let job_id = started["job"]["job_id"].as_i64().unwrap();
    assert_eq!(started["job"]["estimate"], 3);
    let deadline = Instant::now() + Duration::from_secs(20);
    let job = loop {
        let (_, shown) = operate(
            &page,
            port,
            None,
            json!({"action": "show_job", "job_id": job_id}),
        )
        .await;
        if shown["job"]["status"] != "running" {
            break shown["job"].clone();
        }
        assert!(Instant::now() < deadline, "the job did not finish: {shown}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(job["status"], "finished", "{job}");
    assert_eq!(
        (job["done"].as_i64(), job["failed"].as_i64()),
        (Some(3), Some(0))
    );
    let open = open_dead_letters(&pool).await;
    assert_eq!(
        open,
        ["evt_y1"],
        "only what the filter did not match stays open"
    );

    // Aborted before its first step: nothing is taken, and the abort is recorded.
    let registry = shared::effects::EffectRegistry::standard();
    let ask = async |request: Value| {
        let request = shared::operator::parse(request).unwrap();
        serde_json::to_value(
            shared::operator::handle(&pool, &registry, request)
                .await
                .unwrap(),
        )
        .unwrap()
    };
    let started = ask(
        json!({"action": "start_job", "kind": "discard_dead_letters", "all": true,
                             "actor": "bob", "reason": "noise"}),
    )
    .await;
    let job_id = started["job"]["job_id"].as_i64().unwrap();
    assert_eq!(started["job"]["estimate"], 1);
    let aborted = ask(
        json!({"action": "abort_job", "job_id": job_id, "actor": "bob",
                             "reason": "wrong filter"}),
    )
    .await;
    assert_eq!(aborted["job"]["status"], "aborted");
    let ran = ask(json!({"action": "run_job", "job_id": job_id})).await;
    assert_eq!(
        (ran["job"]["status"].as_str(), ran["job"]["done"].as_i64()),
        (Some("aborted"), Some(0))
    );
    let still_open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dead_letters WHERE external_id = 'evt_y1' AND status = 'new'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(still_open, 1);
    let abort_recorded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action = 'abort_job' AND actor = 'bob'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(abort_recorded, 1);
}

/// The SQS buffer's dead letters on the console: listed without their bytes, and redriven to
/// the buffer's queue by a change recorded as the console's actor.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_buffers_dead_letters_are_listed_and_redriven(pool: PgPool) {
    let _shop = Shop::new(pool.clone()).await;
    let (buffer, _queue, dead_letters) = support::buffer_queues().await;
    buffer
        .send_to(
            &dead_letters,
            support::pay_delivery("d-stuck", br#"{"card":"4242-secret-looking"}"#),
        )
        .await
        .unwrap();
    let (url, port) = start_with(
        Backend::direct_with_buffer(pool.clone(), Some(buffer.clone())),
        true,
    )
    .await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let (status, listed) = operate(
        &page,
        port,
        None,
        json!({"action": "list_buffer_dead_letters"}),
    )
    .await;
    assert_eq!(status, 200, "{listed}");
    let letters = listed["buffer_dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["delivery_id"], "d-stuck");
    assert!(
        !listed.to_string().contains("4242"),
        "never the body: {listed}"
    );

    let own = format!("http://127.0.0.1:{port}");
    let (status, redriven) = operate(
        &page,
        port,
        Some(&own),
        json!({"action": "redrive_buffer", "reason": "consumer fixed"}),
    )
    .await;
    assert_eq!(status, 200, "{redriven}");
    assert_eq!(redriven["redriven"]["moved"], 1);
    let (actor, action): (String, String) = sqlx::query_as(
        "SELECT actor, action FROM operator_actions ORDER BY action_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (actor.as_str(), action.as_str()),
        ("alice", "redrive_buffer")
    );
}

/// What a page can and cannot do, in a real browser: a DNS name rebound to 127.0.0.1 (the
/// browser resolves `rebound.example` to loopback, as an attacker's DNS would) gets only the
/// refusal; a page opened without the one-time token gets no session and its API calls are
/// refused; a read-only console's page shows its buttons disabled, and a write the page sends
/// anyway (its own origin, its session, a reason) is refused: nothing changes.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn a_rebound_name_a_page_without_the_token_and_a_write_to_a_read_only_console_are_refused_in_a_browser(
    pool: PgPool,
) {
    let shop = Shop::new(pool.clone()).await;
    shop.deliver("evt_dl", "cus_1").await;
    shop.dead_letter("evt_dl", "retryable: CRM timed out").await;
    let (url, port) = start(&pool, false).await;
    let browser =
        Browser::start_with(&["--host-resolver-rules=MAP rebound.example 127.0.0.1"]).await;
    let fetch = |request: Value| {
        format!(
            "const done = arguments[arguments.length - 1]; \
             fetch('/api/operator', {{method: 'POST', headers: {{'content-type': 'application/json'}}, \
             body: JSON.stringify({request}), credentials: 'same-origin'}}) \
             .then(async (r) => done([r.status, await r.text()]), (e) => done([0, String(e)]));"
        )
    };

    browser.go(&format!("http://rebound.example:{port}/")).await;
    browser
        .text_containing("body", "this console answers only on loopback")
        .await;

    browser.go(&format!("http://127.0.0.1:{port}/")).await;
    browser
        .text_containing("#error", "no session: open the URL hookctl console printed")
        .await;
    let without_token = browser
        .script_async(&fetch(json!({"action": "list_dead_letters"})))
        .await;
    assert_eq!(without_token[0], 401, "{without_token}");

    // A fresh load: from the page above, the URL differs only by its fragment.
    browser.go("about:blank").await;
    browser.go(&url).await;
    browser.text_containing("#mode", "read-only").await;
    browser.click("#nav-dead-letters").await;
    browser
        .text_containing("#dead-letters", "retryable: CRM timed out")
        .await;
    let disabled = browser
        .script("return document.querySelector('#replay-group-0').disabled;")
        .await;
    assert_eq!(disabled, true, "a read-only console's buttons are disabled");
    let write = browser
        .script_async(&fetch(
            json!({"action": "start_job", "kind": "replay_dead_letters",
                                    "all": true, "reason": "try anyway"}),
        ))
        .await;
    assert_eq!(write[0], 403, "{write}");
    assert!(write[1].as_str().unwrap().contains("read-only"), "{write}");
    browser.quit().await;

    let open = open_dead_letters(&pool).await.len();
    let actions: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_actions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((open, actions), (1, 0), "nothing changed, nothing recorded");
}

/// An event's page says how it was verified (the scheme and the secret), whether it came through
/// the SQS buffer, and what it did to its entity: version 1 to 2 for the event that changed it,
/// and for a late, lower version, that it changed nothing and what the entity holds.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn an_events_page_shows_its_verification_the_buffer_and_its_entity_before_and_after(
    pool: PgPool,
) {
    let shop = Shop::new(pool.clone()).await;
    shop.deliver_version("evt_v1", "cus_e", 1).await;
    shop.drain().await;
    shop.deliver_version("evt_v2", "cus_e", 2).await;
    shop.drain().await;
    shop.deliver_version("evt_v0", "cus_e", 0).await;
    shop.drain().await;
    let (url, port) = start(&pool, false).await;
    let page = client();
    assert_eq!(open_session(&page, port, &token_of(&url)).await, 204);
    let history = async |id: &str| {
        let (status, answer) = operate(
            &page,
            port,
            None,
            json!({"action": "event_history", "tenant_id": "acme", "external_id": id}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        answer["history"].clone()
    };

    let changed = history("evt_v2").await;
    assert_eq!(changed["filing"]["scheme"], "stripe");
    assert_eq!(changed["filing"]["verified_with"], "current");
    assert!(
        changed["filing"]["buffered_deliveries"].is_null(),
        "{changed}"
    );
    let change = changed["outbox"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["action"] == "entity.changed")
        .unwrap_or_else(|| panic!("no entity.changed: {changed}"))["change"]
        .clone();
    assert_eq!(
        (&change["previous_version"], &change["version"]),
        (&json!(1), &json!(2)),
        "{change}"
    );
    assert_eq!(changed["entity"]["version"], 2);
    assert_eq!(changed["entity"]["last_event_id"], "evt_v2");

    let first = history("evt_v1").await;
    let change = first["outbox"][0]["change"].clone();
    assert_eq!(
        (&change["previous_version"], &change["version"]),
        (&Value::Null, &json!(1)),
        "a new entity: {change}"
    );

    let late = history("evt_v0").await;
    assert!(
        late["outbox"].as_array().unwrap().is_empty(),
        "a lower version changes nothing: {late}"
    );
    assert_eq!(late["filing"]["entity_version"], 0);
    assert_eq!(late["entity"]["version"], 2, "{late}");
}

/// Every anomaly check has its meaning and what to do in the operating manual's table, which
/// the console shows beside it; the table names no check that does not exist.
#[test]
fn every_check_has_its_meaning_and_what_to_do_in_the_manual() {
    let help = console::check_help();
    let mut checks: Vec<&str> = shared::store::anomaly::GLOBAL_CHECKS
        .iter()
        .map(|c| c.name)
        .chain([
            shared::store::anomaly::VIEW_REFRESH_AGE.name,
            "buffer_dead_letters",
            "source_silence",
            "source_spike",
        ])
        .collect();
    checks.sort_unstable();
    let mut documented: Vec<&str> = help.keys().map(String::as_str).collect();
    documented.sort_unstable();
    assert_eq!(documented, checks);
    for (name, text) in &help {
        for part in ["means", "do"] {
            assert!(
                text[part].as_str().is_some_and(|t| t.len() > 20),
                "{name}: {part} {text}"
            );
        }
    }
    let manual =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operating.md"))
            .unwrap()
            .replace('\n', " ");
    let count = shared::anomaly::global_check_count();
    assert!(
        manual.contains(&format!(
            "measures {count} global checks ({} beside the SQS buffer)",
            count + 1
        )),
        "docs/operating.md's count of checks is not {count}"
    );
}

/// The events of the dead letters still open (`new` or `investigating`).
async fn open_dead_letters(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT external_id FROM dead_letters WHERE status IN ('new', 'investigating') \
         ORDER BY external_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}
