//! `--json` for the catalogue and the routes: `hookctl providers list` and `hookctl routes
//! check|apply|list` print what a script can parse, and say the same as their text.

mod test_database;

use std::path::Path;
use std::process::{Command, Output};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn hookctl(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args(args)
        .current_dir(dir)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run hookctl")
}

/// A directory holding `routes.toml` with `toml` in it.
fn routes_file(toml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("routes.toml"), toml).unwrap();
    dir
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn providers_list_answers_json_with_every_catalogue_entry() {
    let dir = tempfile::tempdir().unwrap();
    let listed = json(&hookctl(&["--json", "providers", "list"], dir.path()));
    let listed = listed.as_array().expect("an array of providers");
    assert_eq!(listed.len(), shared::catalogue::providers().count());
    let stripe = listed
        .iter()
        .find(|p| p["scheme"] == "stripe")
        .expect("stripe is listed");
    assert!(stripe["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(
        stripe["signatures"]
            .as_array()
            .is_some_and(|s| !s.is_empty()),
        "{stripe}"
    );
}

#[test]
fn routes_check_answers_json_with_each_route_read() {
    let dir = routes_file(
        r#"
[[route]]
tenant = "acme"
action = "entity.changed"
destination = "sqs"
queue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/acme-entities.fifo"

[[route]]
tenant = "acme"
source = "acme-github"
action = "event"
name = "issue-tracker"
types = ["issues.*"]
filter = { pointer = "/repository/full_name", in = ["acme/api"] }
destination = "http"
url = "https://tracker.internal/hooks"
signing_secret_ref = "acme/tracker-signing"
rate_limit = 20
"#,
    );
    let checked = json(&hookctl(
        &["--json", "routes", "check", "routes.toml"],
        dir.path(),
    ));
    assert_eq!(checked["valid"], true, "{checked}");
    let routes = checked["routes"].as_array().expect("the routes read");
    assert_eq!(routes.len(), 2, "{checked}");
    assert_eq!(routes[0]["tenant_id"], "acme");
    assert_eq!(routes[0]["source_id"], serde_json::Value::Null);
    assert_eq!(routes[0]["action"], "entity.changed");
    assert_eq!(routes[0]["destination"]["kind"], "sqs");
    assert_eq!(
        routes[0]["destination"]["queue_url"],
        "https://sqs.eu-west-1.amazonaws.com/123456789012/acme-entities.fifo"
    );
    let subscription = &routes[1];
    assert_eq!(subscription["message_action"], "event:issue-tracker");
    assert_eq!(subscription["signing_secret_ref"], "acme/tracker-signing");
    assert_eq!(subscription["subscription"]["name"], "issue-tracker");
    assert_eq!(
        subscription["subscription"]["event_types"],
        serde_json::json!(["issues.*"])
    );
    assert_eq!(
        subscription["subscription"]["filter"]["values"],
        serde_json::json!(["acme/api"])
    );
    assert_eq!(subscription["subscription"]["rate_limit"], 20.0);

    // A route file that is not valid still exits 2 with the reason on standard error.
    std::fs::write(
        dir.path().join("bad.toml"),
        "[[route]]\ntenant = \"acme\"\naction = \"nothing.known\"\ndestination = \"sqs\"\n",
    )
    .unwrap();
    let bad = hookctl(&["--json", "routes", "check", "bad.toml"], dir.path());
    assert_eq!(bad.status.code(), Some(2));
}

/// What `routes apply --json` stored, `routes list --json` reads back the same.
#[sqlx::test(migrator = "shared::store::MIGRATOR")]
async fn routes_apply_and_list_answer_json(_pool: PgPoolOptions, connect: PgConnectOptions) {
    let dir = routes_file(
        r#"
[[route]]
tenant = "acme"
action = "fulfil_order"
destination = "eventbridge"
bus = "orders"
event_source = "acme.payments"
"#,
    );
    let url = test_database::url(&connect);
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hookctl"))
            .args(args)
            .current_dir(dir.path())
            .env("DATABASE_URL", &url)
            .output()
            .expect("run hookctl")
    };
    let applied = json(&run(&["--json", "routes", "apply", "routes.toml"]));
    assert_eq!(applied["applied"], 1, "{applied}");
    let listed = json(&run(&["--json", "routes", "list"]));
    assert_eq!(listed["routes"], applied["routes"], "{listed}");
    assert_eq!(
        listed["routes"][0]["destination"],
        serde_json::json!({"kind": "eventbridge", "bus": "orders", "event_source": "acme.payments"})
    );
}
