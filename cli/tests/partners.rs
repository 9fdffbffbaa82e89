//! A partner that does not sign, against `hookctl serve` as a developer runs it: the runner
//! serves `/partners/{source_id}` over TLS with client certificates (`--partner-listen`), the
//! certificates made with `openssl` as docs/deploying.md makes them (our CA, a partner's
//! certificate), and the test connects as the partner would, and as four others would: a
//! certificate of our CA that the source does not pin, no certificate, the pinned certificate
//! from an address outside the source's CIDRs (127.0.0.2), and no token. What `hookctl
//! refused` and `hookctl sources certificates` then show is printed, and asserted.

mod test_database;

use std::net::IpAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const HOOKCTL: &str = env!("CARGO_BIN_EXE_hookctl");
const TOKEN: &str = "globex-token-7f3a";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl: ./scripts/test installs it");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Our CA, the listener's certificate (for 127.0.0.1), and a client certificate `<name>.pem`
/// of the CA valid for `days`.
fn certificates(dir: &Path, clients: &[(&str, u32)]) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-sha256",
            "-days",
            "30",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=test partners CA",
        ],
    );
    std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    let sign = |name: &str, days: u32, ext: &str| {
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={name}"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                &days.to_string(),
                "-sha256",
                "-extfile",
                ext,
                "-out",
                &format!("{name}.pem"),
            ],
        );
    };
    sign("server", 30, "server.ext");
    for (name, days) in clients {
        sign(name, *days, "client.ext");
    }
}

fn hookctl(url: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(HOOKCTL)
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A client of the partner listener: trusting our CA, presenting `identity` (a certificate and
/// its key) when given, connecting from `from`.
fn client(dir: &Path, identity: Option<&str>, from: [u8; 4]) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(dir.join("ca.pem")).unwrap()).unwrap();
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca)
        .local_address(IpAddr::from(from))
        .timeout(Duration::from_secs(10));
    if let Some(name) = identity {
        let mut pem = std::fs::read(dir.join(format!("{name}.pem"))).unwrap();
        pem.extend(std::fs::read(dir.join(format!("{name}.key"))).unwrap());
        builder = builder.identity(reqwest::Identity::from_pem(&pem).unwrap());
    }
    builder.build().unwrap()
}

#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn the_local_runner_admits_a_pinned_partner_and_refuses_each_bad_case(
    pool_options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool: PgPool = pool_options.connect_with(connect.clone()).await.unwrap();
    let url = test_database::url(&connect);
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    // The partner's certificate expires in 20 days: the expiry check warns 30 days ahead.
    certificates(dir, &[("globex", 20), ("stranger", 30)]);
    let (ok, pin) = hookctl(
        &url,
        &[
            "sources",
            "fingerprint",
            "--pem",
            dir.join("globex.pem").to_str().unwrap(),
        ],
    );
    assert!(ok, "{pin}");
    let pin = pin.trim().to_owned();
    assert_eq!(pin.len(), 64, "{pin}");
    std::fs::write(
        dir.join("sources.toml"),
        format!(
            "[[source]]\nid = \"globex\"\ntenant = \"acme\"\nauth = \"partner\"\n\
             secret_ref = \"partners/globex\"\n\
             [source.partner]\nclient_certificates = [\"{pin}\"]\ncidrs = [\"127.0.0.1/32\"]\n\
             token_header = \"authorization\"\nevent_id_header = \"x-partner-event-id\"\n\
             [source.fields]\nevent_type = \"json:/type\"\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("secrets.toml"),
        format!("[secrets.\"partners/globex\"]\ncurrent = \"{TOKEN}\"\n"),
    )
    .unwrap();
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let (port, partner_port) = (free(), free());
    let path = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let _runner = tokio::process::Command::new(HOOKCTL)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--sources",
            &path("sources.toml"),
            "--secrets-file",
            &path("secrets.toml"),
            "--partner-listen",
            &format!("127.0.0.1:{partner_port}"),
            "--partner-tls-cert",
            &path("server.pem"),
            "--partner-tls-key",
            &path("server.key"),
            "--partner-client-ca",
            &path("ca.pem"),
        ])
        .env("DATABASE_URL", &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("runner.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let endpoint = format!("https://127.0.0.1:{partner_port}/partners/globex");
    let send = |client: reqwest::Client, id: &'static str, token: Option<&'static str>| {
        let endpoint = endpoint.clone();
        async move {
            let mut request = client
                .post(&endpoint)
                .header("x-partner-event-id", id)
                .header("content-type", "application/json")
                .body(format!(r#"{{"type":"order.created","id":"{id}"}}"#));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            request.send().await
        }
    };
    let partner = client(dir, Some("globex"), [127, 0, 0, 1]);
    let give_up = Instant::now() + Duration::from_secs(30);
    let admitted = loop {
        match send(partner.clone(), "ord-1001", Some(TOKEN)).await {
            Ok(reply) => break reply,
            Err(e) => {
                assert!(
                    Instant::now() < give_up,
                    "partner listener not up: {e:?}\n{}",
                    std::fs::read_to_string(dir.join("runner.log")).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(admitted.status(), 200);
    assert_eq!(
        admitted.json::<serde_json::Value>().await.unwrap(),
        serde_json::json!({"status": "accepted"})
    );
    let again = send(partner.clone(), "ord-1001", Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(
        again.json::<serde_json::Value>().await.unwrap(),
        serde_json::json!({"status": "duplicate"})
    );

    // The four bad cases, each refused before anything is stored.
    let unpinned = send(
        client(dir, Some("stranger"), [127, 0, 0, 1]),
        "ord-2",
        Some(TOKEN),
    )
    .await
    .unwrap();
    assert_eq!(unpinned.status(), 403);
    let no_certificate = send(client(dir, None, [127, 0, 0, 1]), "ord-3", Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(no_certificate.status(), 401);
    let outside = send(
        client(dir, Some("globex"), [127, 0, 0, 2]),
        "ord-4",
        Some(TOKEN),
    )
    .await
    .unwrap();
    assert_eq!(outside.status(), 403);
    let no_token = send(partner.clone(), "ord-5", None).await.unwrap();
    assert_eq!(no_token.status(), 401);
    let wrong_token = send(partner.clone(), "ord-6", Some("guessed"))
        .await
        .unwrap();
    assert_eq!(wrong_token.status(), 401);

    let stored: Vec<(String, i32)> = sqlx::query_as(
        "SELECT external_id, delivery_count FROM webhook_events ORDER BY external_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        stored,
        [("ord-1001".to_owned(), 2)],
        "only the partner's event"
    );
    let kept: Vec<(String, i16)> = sqlx::query_as(
        "SELECT check_failed, status FROM refused_deliveries WHERE source_id = 'globex' \
         ORDER BY refusal_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let checks: Vec<&str> = kept.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(
        checks[..4],
        [
            "certificate_not_pinned",
            "no_client_certificate",
            "address_not_allowed",
            "missing_header"
        ],
        "{kept:?}"
    );
    assert_eq!(kept.len(), 5, "the wrong token too: {kept:?}");

    let (ok, refused) = hookctl(&url, &["refused", "--source", "globex"]);
    assert!(ok);
    println!("$ hookctl refused --source globex\n{refused}");
    for check in [
        "certificate_not_pinned",
        "no_client_certificate",
        "address_not_allowed",
    ] {
        assert!(refused.contains(check), "{check}: {refused}");
    }
    let (ok, seen) = hookctl(&url, &["sources", "certificates"]);
    assert!(ok);
    println!("$ hookctl sources certificates\n{seen}");
    assert!(
        seen.contains(&pin) && seen.contains("pinned") && seen.contains("CN=globex"),
        "{seen}"
    );
    assert!(
        !seen.contains("stranger"),
        "a refused certificate is not recorded: {seen}"
    );

    // The partner's certificate expires within 30 days: the check says so.
    shared::anomaly::run_once(&pool, &Default::default(), "test")
        .await
        .unwrap();
    let expiring: Option<f64> = sqlx::query_scalar(
        "SELECT value FROM anomaly_results WHERE check_name = 'partner_certificates_expiring' \
         ORDER BY run_id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(expiring, Some(1.0));
}
