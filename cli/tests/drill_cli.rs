//! `hookctl drill --short` as CI runs it: the binary against a real PostgreSQL, its matrix on
//! standard output, its progress on standard error, its verdict in the exit code. The drill
//! fails (exit 1) when a fault goes unnoticed by every layer without being harmless by design,
//! or a fault the design repairs is not repaired; this test reads the matrix itself too.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn url(connect: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        connect.get_username(),
        connect.get_host(),
        connect.get_port(),
        connect.get_database().unwrap()
    )
}

#[sqlx::test(migrations = false)]
async fn the_short_drill_notices_every_fault_and_repairs_what_the_design_repairs(
    _pool: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args(["drill", "--short", "--json"])
        .env("DATABASE_URL", url(&connect))
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    // Progress while it runs, on stderr, one line per fault when piped.
    assert!(
        stderr.contains("drill [14/14] vacuum_starvation"),
        "{stderr}"
    );
    let matrix: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(matrix["ok"], true);
    let rows = matrix["rows"].as_array().unwrap();
    let row = |fault: &str| {
        rows.iter()
            .find(|r| r["fault"] == fault)
            .unwrap_or_else(|| panic!("no row {fault}: {stdout}"))
    };
    let noticed = |fault: &str, layer: &str| -> Vec<String> {
        row(fault)["noticed"][layer]
            .as_array()
            .map(|a| a.iter().map(|e| e.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default()
    };
    let repaired = |fault: &str| row(fault)["repair"]["result"].as_str().unwrap().to_owned();

    assert_eq!(rows.len(), 14, "the control and 13 fault classes");
    // The control notices nothing: what the other rows show is the fault's.
    assert_eq!(row("none (control)")["noticed"], serde_json::json!({}));
    for r in rows {
        assert_eq!(r["problems"], serde_json::json!([]), "{r}");
        let anyone = r["noticed"]
            .as_object()
            .unwrap()
            .values()
            .any(|v| !v.as_array().unwrap().is_empty());
        assert!(
            anyone || r["harmless_by_design"].is_string(),
            "unnoticed and not harmless by design: {r}"
        );
    }
    // Each layer does the noticing the design gives it.
    assert!(noticed("lost_delivery", "backfill").contains(&"backfilled=1".to_owned()));
    assert_eq!(repaired("lost_delivery"), "repaired");
    assert_eq!(noticed("duplicate_storm", "ingest"), ["duplicate×80"]);
    assert!(noticed("lost_queue_row", "reconcile").contains(&"orphaned_pending=3".to_owned()));
    assert!(
        noticed("deleted_effect", "reconcile")
            .iter()
            .any(|e| e.starts_with("missing_effects="))
    );
    assert_eq!(
        noticed("deleted_outbox_row", "reconcile"),
        ["missing_outbox=1"]
    );
    assert!(
        noticed("outbox_target_down", "outbox")
            .iter()
            .any(|e| e.starts_with("retried="))
    );
    assert_eq!(noticed("poison_event", "drain"), ["dead_lettered=1"]);
    assert!(noticed("poison_event", "alarm").contains(&"dead-letters".to_owned()));
    assert_eq!(noticed("signature_storm", "ingest"), ["401×30"]);
    assert_eq!(noticed("signature_storm", "alarm"), ["signature-failures"]);
    assert_eq!(noticed("digest_conflict", "ingest"), ["conflict×1"]);
    assert!(
        noticed("digest_conflict", "checks").contains(&"digest_conflicts_last_hour".to_owned())
    );
    assert_eq!(noticed("silent_source", "checks"), ["source_silence:shop"]);
    assert_eq!(
        noticed("vacuum_starvation", "checks"),
        ["longest_open_transaction_seconds"]
    );
    for fault in [
        "lost_delivery",
        "duplicate_storm",
        "lost_queue_row",
        "deleted_effect",
        "deleted_outbox_row",
        "outbox_target_down",
        "reordering",
        "drainer_killed",
    ] {
        assert_eq!(repaired(fault), "repaired", "{fault}: {stdout}");
    }
    assert_eq!(repaired("signature_storm"), "nothing_to_repair");
    for fault in [
        "poison_event",
        "digest_conflict",
        "silent_source",
        "vacuum_starvation",
    ] {
        assert_eq!(repaired(fault), "needs_human", "{fault}");
        assert_ne!(
            row(fault)["status"],
            serde_json::json!([]),
            "status must say so: {fault}"
        );
    }
    assert_eq!(row("poison_event")["status"][0], "open_dead_letters");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(120),
        "the short form took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn the_drill_refuses_an_unknown_fault_and_a_missing_database() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookctl"))
        .args(["drill", "--short"])
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
