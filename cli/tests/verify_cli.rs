//! `hookctl verify` as an operator runs it: captured headers and a raw body on disk, a scheme
//! and secret in the environment, the verdict on standard output and in the exit code.

mod test_database;

use std::path::Path;
use std::process::{Command, Output};

fn hookctl(args: &[&str], secret: &str, dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args(args)
        .env("HOOKCTL_SECRET", secret)
        .current_dir(dir)
        .output()
        .expect("run hookctl")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Signs with `hookctl sign`, as a provider would, and captures the headers like `curl -v`.
fn capture(dir: &Path, scheme: &str, secret: &str, body: &str, at: i64) {
    std::fs::write(dir.join("body.json"), body).unwrap();
    let signed = hookctl(
        &[
            "sign",
            "--scheme",
            scheme,
            "--body",
            "body.json",
            "--at",
            &at.to_string(),
        ],
        secret,
        dir,
    );
    assert!(
        signed.status.success(),
        "{}",
        String::from_utf8_lossy(&signed.stderr)
    );
    let captured: String = std::iter::once("> POST /webhooks/demo HTTP/1.1\r\n".to_owned())
        .chain(stdout(&signed).lines().map(|l| format!("> {l}\r\n")))
        .chain(["> Content-Type: application/json\r\n".to_owned()])
        .collect();
    std::fs::write(dir.join("headers.txt"), captured).unwrap();
}

const BODY: &str = r#"{"id":"evt_1","type":"charge.succeeded"}"#;

#[test]
fn a_valid_capture_exits_0_and_names_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    capture(dir.path(), "stripe", "whsec_abc", BODY, 1_700_000_000);
    let out = hookctl(
        &[
            "verify",
            "--scheme",
            "stripe",
            "--headers",
            "headers.txt",
            "--body",
            "body.json",
            "--at",
            "1700000030",
        ],
        "whsec_abc",
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(
        stdout(&out).contains(
            "VALID: the signature matches the current secret, signed 30 s ago (tolerance 300 s)"
        ),
        "{}",
        stdout(&out)
    );
}

#[test]
fn each_failure_exits_1_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    capture(dir.path(), "stripe", "whsec_abc", BODY, 1_700_000_000);
    let verify = |extra: &[&str], secret: &str| {
        let mut args = vec![
            "verify",
            "--scheme",
            "stripe",
            "--headers",
            "headers.txt",
            "--body",
            "body.json",
        ];
        args.extend_from_slice(extra);
        hookctl(&args, secret, dir.path())
    };

    let stale = verify(&["--at", "1700000400"], "whsec_abc");
    assert_eq!(stale.status.code(), Some(1));
    assert!(
        stdout(&stale).contains("INVALID: timestamp 100 s older than the tolerance of 300 s"),
        "{}",
        stdout(&stale)
    );

    let wrong_secret = verify(&["--at", "1700000000"], "whsec_other");
    assert_eq!(wrong_secret.status.code(), Some(1));
    assert!(stdout(&wrong_secret).contains("INVALID: no candidate matches"));

    let previous = hookctl(
        &[
            "verify",
            "--scheme",
            "stripe",
            "--previous-secret",
            "whsec_abc",
            "--headers",
            "headers.txt",
            "--body",
            "body.json",
            "--at",
            "1700000000",
        ],
        "whsec_new",
        dir.path(),
    );
    assert_eq!(previous.status.code(), Some(0));
    assert!(stdout(&previous).contains("matches the previous secret"));

    std::fs::write(dir.path().join("body.json"), format!("{BODY}\n")).unwrap();
    let newline = verify(&["--at", "1700000000"], "whsec_abc");
    assert_eq!(newline.status.code(), Some(1));
    assert!(stdout(&newline).contains("trailing newline"));

    let no_header = hookctl(
        &[
            "verify",
            "--scheme",
            "github",
            "-H",
            "X-GitHub-Event: push",
            "--body",
            "body.json",
        ],
        "s",
        dir.path(),
    );
    assert_eq!(no_header.status.code(), Some(1));
    assert!(stdout(&no_header).contains("INVALID: no x-hub-signature-256 header"));

    let malformed = hookctl(
        &[
            "verify",
            "--scheme",
            "github",
            "-H",
            "X-Hub-Signature-256: sha1=abc",
            "--body",
            "body.json",
        ],
        "s",
        dir.path(),
    );
    assert_eq!(malformed.status.code(), Some(1));
    assert!(
        stdout(&malformed)
            .contains("INVALID: malformed x-hub-signature-256 header: does not start with sha256=")
    );
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out = hookctl(
        &["verify", "--scheme", "stripe", "--body", "missing.json"],
        "s",
        dir.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
}

/// Against a configured source: its scheme, secrets and field map come from the database and
/// the secrets backend, exactly as ingest reads them.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn verify_against_a_configured_source(
    pool_options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let pool = pool_options.connect_with(connect.clone()).await.unwrap();
    let file =
        "[[source]]\nid = 'pay'\ntenant = 'acme'\nscheme = 'stripe'\nsecret_ref = 'local/pay'\n";
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("sources.toml"), file).unwrap();
    std::fs::write(
        dir.path().join("secrets.toml"),
        "[secrets.\"local/pay\"]\ncurrent = \"whsec_pay\"\n",
    )
    .unwrap();
    let sources = shared::sources::read_sources_file(&dir.path().join("sources.toml")).unwrap();
    shared::sources::apply(&pool, &sources).await.unwrap();
    let url = test_database::url(&connect);
    let run = |body: &str| {
        capture(dir.path(), "stripe", "whsec_pay", body, 1_700_000_000);
        Command::new(env!("CARGO_BIN_EXE_hookctl"))
            .args([
                "verify",
                "--source",
                "pay",
                "--secrets-file",
                "secrets.toml",
                "--headers",
                "headers.txt",
                "--body",
                "body.json",
                "--at",
                "1700000000",
            ])
            .env("DATABASE_URL", &url)
            .current_dir(dir.path())
            .output()
            .unwrap()
    };

    let ok = run(BODY);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}{}",
        stdout(&ok),
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(stdout(&ok).starts_with("source pay (tenant acme, secret local/pay)"));
    assert!(stdout(&ok).contains("event id \"evt_1\", type \"charge.succeeded\""));

    let unfileable = run(r#"{"type":"charge.succeeded"}"#);
    assert_eq!(unfileable.status.code(), Some(1));
    assert!(
        stdout(&unfileable).contains("UNFILEABLE: no event id at json:/id"),
        "{}",
        stdout(&unfileable)
    );
}

/// `--json`, which every other command honours, gives a script what it can read without
/// parsing text: `sign` an object of the headers it would send, `verify` the verdict and its
/// lines (the exit codes unchanged). The headers `sign --json` gives verify.
#[test]
fn sign_and_verify_answer_json_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("body.json"), BODY).unwrap();
    let signed = hookctl(
        &[
            "--json",
            "sign",
            "--scheme",
            "stripe",
            "--body",
            "body.json",
            "--at",
            "1700000000",
        ],
        "whsec_abc",
        dir.path(),
    );
    assert_eq!(signed.status.code(), Some(0), "{}", stdout(&signed));
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&stdout(&signed)).expect("sign --json prints one JSON object");
    let signature = headers
        .get("stripe-signature")
        .and_then(|v| v.as_str())
        .expect("the Stripe-Signature header, by its name");
    assert!(signature.starts_with("t=1700000000,v1="), "{signature}");

    let verify = |secret: &str| {
        hookctl(
            &[
                "--json",
                "verify",
                "--scheme",
                "stripe",
                "-H",
                &format!("Stripe-Signature: {signature}"),
                "--body",
                "body.json",
                "--at",
                "1700000030",
            ],
            secret,
            dir.path(),
        )
    };
    let valid = verify("whsec_abc");
    assert_eq!(valid.status.code(), Some(0), "{}", stdout(&valid));
    let report: serde_json::Value = serde_json::from_str(&stdout(&valid)).unwrap();
    assert_eq!(report["valid"], true);
    assert!(
        report["lines"]
            .as_array()
            .is_some_and(|lines| lines.iter().any(|l| {
                l.as_str().is_some_and(|l| {
                    l.starts_with("VALID: the signature matches the current secret")
                })
            })),
        "{report}"
    );
    let invalid = verify("whsec_other");
    assert_eq!(invalid.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_str(&stdout(&invalid)).unwrap();
    assert_eq!(report["valid"], false, "{report}");
}
