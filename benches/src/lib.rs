//! Measurement helpers shared by the benchmarks.

use std::time::{Duration, Instant};

use shared::domain::{Scheme, SourceId, TenantId};
use shared::extract::FieldMap;
use shared::sources::Source;

/// The enabled source `bench` (tenant and secret `bench`) with the scheme's default field map.
pub fn source(scheme: Scheme, tolerance: Duration) -> Source {
    Source {
        source_id: SourceId::parse("bench").unwrap(),
        tenant_id: TenantId::parse("bench").unwrap(),
        scheme,
        secret_ref: "bench".into(),
        tolerance,
        fields: FieldMap::defaults_for(scheme),
        enabled: true,
        signed_url: None,
        signature: None,
        layouts: None,
        json_form_field: None,
        address_check: None,
        partner: None,
        gaps: None,
    }
}

/// The payload size the ingest and buffer benchmarks store.
pub const PAYLOAD_BYTES: usize = 1024;

/// A Stripe `payment_intent.succeeded` event `id`, padded to [`PAYLOAD_BYTES`].
pub fn stripe_event_body(id: &str) -> Vec<u8> {
    let mut body = serde_json::json!({
        "id": id, "object": "event", "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_bench", "amount": 4200, "currency": "eur", "padding": ""}}
    });
    let base = serde_json::to_vec(&body).unwrap().len();
    body["data"]["object"]["padding"] =
        serde_json::Value::String("x".repeat(PAYLOAD_BYTES.saturating_sub(base)));
    serde_json::to_vec(&body).unwrap()
}

/// `POST /webhooks/bench` as API Gateway hands it to the ingest handler, Stripe-signed with
/// `secret` at Unix time `at`.
pub fn signed_request(body: Vec<u8>, at: i64, secret: &str) -> lambda_http::Request {
    let headers = shared::signature::sign(
        Scheme::Stripe,
        &shared::secrets::SigningSecret::new(secret),
        "",
        at,
        &body,
    )
    .unwrap();
    api_gateway_request("bench", headers, body)
}

/// `POST /webhooks/<source_id>` as API Gateway hands it to the ingest handler: these signature
/// headers, a JSON content type, the route's path parameter.
pub fn api_gateway_request(
    source_id: &str,
    signature: Vec<(http::HeaderName, http::HeaderValue)>,
    body: Vec<u8>,
) -> lambda_http::Request {
    use lambda_http::RequestExt;
    let headers: http::HeaderMap = signature
        .into_iter()
        .chain([(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )])
        .collect();
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("/webhooks/{source_id}"))
        .body(lambda_http::Body::Binary(body))
        .unwrap();
    *req.headers_mut() = headers;
    req.with_path_parameters(std::collections::HashMap::from([(
        "source_id".to_owned(),
        source_id.to_owned(),
    )]))
}

/// The ingest path over `pool` as the function builds it, its secrets in memory: `bench`
/// holds `secret`; bodies up to 1 MiB.
pub fn memory_ingestor(pool: sqlx::PgPool, secret: &str) -> shared::ingest::Ingestor {
    let registry = std::sync::Arc::new(shared::sources::SourceRegistry::new(
        pool.clone(),
        Duration::from_secs(3600),
    ));
    let secrets = shared::secrets::SecretStore::memory([(
        "bench".to_owned(),
        shared::secrets::SecretSet::new(secret, None),
    )]);
    shared::ingest::Ingestor::new(
        pool,
        registry,
        std::sync::Arc::new(secrets),
        shared::ingest::IngestLimits {
            max_body_bytes: 1 << 20,
        },
    )
}

/// Sends the prebuilt requests through the ingest handler from `concurrency` tasks until
/// `seconds` pass, each answered 200; what each request counts is `per_request` (1 event, or
/// a batch's elements). Returns the count per second.
pub async fn drive_handler(
    ingestor: std::sync::Arc<shared::ingest::Ingestor>,
    prebuilt: Vec<lambda_http::Request>,
    concurrency: usize,
    seconds: u64,
    per_request: usize,
) -> f64 {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let prebuilt: std::sync::Arc<Vec<_>> = std::sync::Arc::new(
        prebuilt
            .into_iter()
            .map(|r| std::sync::Mutex::new(Some(r)))
            .collect(),
    );
    let next = std::sync::Arc::new(AtomicUsize::new(0));
    let done = std::sync::Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (ingestor, prebuilt, next, done) = (
                ingestor.clone(),
                prebuilt.clone(),
                next.clone(),
                done.clone(),
            );
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let Some(slot) = prebuilt.get(n) else {
                        panic!("ran out of prebuilt requests: prebuild more a second");
                    };
                    let req = slot.lock().unwrap().take().unwrap();
                    let response = ingest::handler(req, &ingestor).await.unwrap();
                    assert_eq!(response.status(), 200, "{:?}", response.body());
                    done.fetch_add(per_request, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// The direct path's single-row upsert with its parameters replaced by pgbench expressions: a
/// fresh event id per transaction (`pg_l<level>_<client>_<n>`), a [`PAYLOAD_BYTES`] payload.
pub fn pgbench_upsert_script(level: usize) -> String {
    let body = stripe_event_body("evt_pgbench");
    let digest = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&body))
    };
    let headers = serde_json::json!({"content-type": "application/json", "stripe-signature": format!("t=1700000000,v1={}", "0".repeat(64))});
    let params = [
        "'bench'".to_owned(),
        format!("'pg_l{level}_' || :client_id || '_' || :n"),
        "'bench'".to_owned(),
        "'payment_intent.succeeded'".to_owned(),
        "'pi_bench'".to_owned(),
        "NULL::bigint".to_owned(),
        "NULL::bigint".to_owned(),
        format!("'\\x{}'::bytea", hex::encode(&body)),
        format!("'\\x{digest}'::bytea"),
        format!("'{headers}'::jsonb"),
        "'current'".to_owned(),
        "0".to_owned(),
        "false".to_owned(),
        "NULL::bigint".to_owned(),
        // The body's claim key: its digest, as for every layout that signs the body.
        format!("'\\x{digest}'::bytea"),
        // No layout name: Stripe has one layout, so ingest records none (`event_filings`).
        "NULL::text".to_owned(),
    ];
    let sql = shared::store::webhook_events::upsert_sql();
    let mut out = String::new();
    let mut rest = sql;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let digits: String = rest[i + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let n: usize = digits.parse().expect("placeholder number");
        out.push_str(&params[n - 1]);
        rest = &rest[i + 1 + digits.len()..];
    }
    out.push_str(rest);
    // pgbench reads one SQL command per line unless it ends with a semicolon; flatten it.
    let flat: String = out.lines().map(str::trim).collect::<Vec<_>>().join(" ");
    format!("\\set n random(1, 1000000000000)\n{flat};\n")
}

/// Two closures timed side by side: see [`paired_ns_per_op`].
#[derive(Debug, Clone, Copy)]
pub struct Paired {
    /// Median nanoseconds per call of the first.
    pub a_ns: f64,
    /// Median nanoseconds per call of the second.
    pub b_ns: f64,
    /// The median of each pair of batches' own ratio (first over second). A slow spell of the
    /// machine lasting longer than a pair slows both of its batches alike and leaves their
    /// ratio, where it moves one median more than the other when it falls on more of one
    /// closure's batches; so this is the figure to hold to a limit, and it can differ a little
    /// from `a_ns / b_ns`.
    pub ratio: f64,
}

/// Median nanoseconds per call of two closures, over `batches` pairs of batches each sized to
/// last about `batch_time`, the two run one after the other in each pair (which goes first
/// alternating) so machine noise hits both alike.
pub fn paired_ns_per_op(
    mut a: impl FnMut(),
    mut b: impl FnMut(),
    batches: usize,
    batch_time: Duration,
) -> Paired {
    let calibrate = |f: &mut dyn FnMut()| {
        let mut n = 1u64;
        loop {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            if start.elapsed() >= batch_time / 4 {
                return n * 4;
            }
            n *= 2;
        }
    };
    let (na, nb) = (calibrate(&mut a), calibrate(&mut b));
    let time = |f: &mut dyn FnMut(), n: u64| {
        let start = Instant::now();
        for _ in 0..n {
            f();
        }
        start.elapsed().as_nanos() as f64 / n as f64
    };
    let mut ta = Vec::with_capacity(batches);
    let mut tb = Vec::with_capacity(batches);
    let mut ratios = Vec::with_capacity(batches);
    for i in 0..batches {
        let (x, y) = if i % 2 == 0 {
            let x = time(&mut a, na);
            (x, time(&mut b, nb))
        } else {
            let y = time(&mut b, nb);
            (time(&mut a, na), y)
        };
        ta.push(x);
        tb.push(y);
        ratios.push(x / y);
    }
    Paired {
        a_ns: median(&mut ta),
        b_ns: median(&mut tb),
        ratio: median(&mut ratios),
    }
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|x, y| x.partial_cmp(y).expect("no NaN"));
    values[values.len() / 2]
}

/// Where pgbench is: `PGBENCH`, PostgreSQL's bin directories, or the PATH.
pub fn pgbench() -> Option<std::path::PathBuf> {
    if let Ok(path) = std::env::var("PGBENCH") {
        return Some(path.into());
    }
    let mut dirs: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"))
        .filter(|p| p.exists())
        .collect();
    dirs.sort();
    dirs.pop().or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("pgbench"))
                .find(|p| p.exists())
        })
    })
}

/// A database of its own for one benchmark run, migrated; dropped by [`BenchDatabase::drop`].
pub struct BenchDatabase {
    pub pool: sqlx::PgPool,
    pub options: sqlx::postgres::PgConnectOptions,
    admin: sqlx::PgConnection,
    name: String,
}

impl BenchDatabase {
    /// Creates `<prefix>_<pid>` on the server of `DATABASE_URL` and applies the migrations.
    pub async fn create(prefix: &str) -> Self {
        use sqlx::{ConnectOptions, Executor};
        let url = std::env::var("DATABASE_URL")
            .expect("DATABASE_URL is not set (./scripts/bench sets it)");
        let admin_options: sqlx::postgres::PgConnectOptions = url.parse().expect("DATABASE_URL");
        let name = format!("{prefix}_{}", std::process::id());
        let mut admin = admin_options
            .connect()
            .await
            .expect("connect to DATABASE_URL");
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create the bench database");
        let options = admin_options.database(&name);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options.clone())
            .await
            .expect("connect");
        shared::store::MIGRATOR.run(&pool).await.expect("migrate");
        Self {
            pool,
            options,
            admin,
            name,
        }
    }

    /// A URL of the bench database (trust auth, as on the bench machines).
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@{}:{}/{}",
            self.options.get_username(),
            self.options.get_host(),
            self.options.get_port(),
            self.name
        )
    }

    pub async fn drop(mut self) {
        use sqlx::Executor;
        self.pool.close().await;
        self.admin
            .execute(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE {} WITH (FORCE)",
                self.name
            )))
            .await
            .expect("drop the bench database");
    }
}

/// Runs a pgbench script (`-M prepared`, no vacuum) against the database for `seconds` with
/// `clients` connections; returns transactions per second.
pub fn pgbench_tps(
    options: &sqlx::postgres::PgConnectOptions,
    clients: usize,
    seconds: u64,
    script: &str,
) -> f64 {
    let path = std::env::temp_dir().join(format!("bench-{}-{clients}.sql", std::process::id()));
    std::fs::write(&path, script).expect("write the pgbench script");
    let output = std::process::Command::new(
        pgbench().expect("pgbench not found: set PGBENCH or install PostgreSQL's binaries"),
    )
    .args([
        "-n",
        "-M",
        "prepared",
        "-c",
        &clients.to_string(),
        "-j",
        &clients.min(2).to_string(),
    ])
    .args(["-T", &seconds.to_string(), "-f"])
    .arg(&path)
    .args([
        "-h",
        options.get_host(),
        "-p",
        &options.get_port().to_string(),
        "-U",
        options.get_username(),
    ])
    .arg(options.get_database().expect("a database name"))
    .output()
    .expect("run pgbench");
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "pgbench failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l["tps = ".len()..].split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("pgbench printed no tps")
}

/// The MAC of `body` under `key`, computed once: the tag the raw `verify_slice` calls of the
/// signature benchmarks compare against.
pub fn hmac_tag<M: hmac::Mac + hmac::digest::KeyInit>(key: &[u8], body: &[u8]) -> Vec<u8> {
    let mut mac = <M as hmac::digest::KeyInit>::new_from_slice(key).expect("HMAC takes any key");
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

/// A declared HMAC-SHA-512 layout (`x-bench-signature: sha512=<hex>` over the body), as a
/// source would write it: no catalogue entry signs with SHA-512.
pub fn declared_sha512() -> &'static shared::catalogue::SignatureSpec {
    let layout = toml::from_str(
        "kind = 'hmac'\nhash = 'sha512'\nheader = 'x-bench-signature'\nprefix = 'sha512='\nsigned = ['{body}']\n",
    )
    .expect("the bench layout parses");
    shared::catalogue::declare(layout).expect("the bench layout is valid")
}

/// The line a bench prints to say where its processes ran: `CPUs: ` and BENCH_TOPOLOGY, which
/// `./scripts/bench` sets when it puts PostgreSQL on a core of its own (as RDS is a machine of
/// its own), else every core shared by PostgreSQL and `shared_with`.
pub fn cpus_line(shared_with: &str) -> String {
    let topology = std::env::var("BENCH_TOPOLOGY")
        .unwrap_or_else(|_| format!("every core shared by PostgreSQL, {shared_with}"));
    format!("CPUs: {topology}")
}

#[cfg(test)]
mod tests {
    /// The pgbench limit runs the direct path's statement as it stands: every placeholder it
    /// has is given a value (a new one added to the statement must be given one here too).
    #[test]
    fn the_pgbench_script_gives_every_placeholder_of_the_upsert_a_value() {
        let script = super::pgbench_upsert_script(1);
        assert!(!script.contains('$'), "{script}");
        assert!(script.contains("INSERT INTO webhook_events"), "{script}");
    }
}
