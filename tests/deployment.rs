//! The SAM stack checked against the code: every function crate is deployed and every deployed
//! function has a crate; every alarm watches a metric that exists (emitted by our code, or an
//! AWS service metric of a resource in the stack); the migrations resource tracks the newest
//! migration; no IAM statement grants a wildcard action. `cfn-lint` validates the rest
//! (scripts/test runs it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_norway::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn template() -> Value {
    let text = std::fs::read_to_string(root().join("template.yaml")).unwrap();
    serde_norway::from_str(&text).unwrap()
}

fn resources(t: &Value) -> Vec<(String, Value)> {
    t["Resources"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
        .collect()
}

fn of_type(t: &Value, kind: &str) -> Vec<(String, Value)> {
    resources(t)
        .into_iter()
        .filter(|(_, r)| r["Type"].as_str() == Some(kind))
        .collect()
}

/// `!Ref X` → "X".
fn reference(v: &Value) -> Option<String> {
    match v {
        Value::Tagged(t) if t.tag == "Ref" => t.value.as_str().map(str::to_owned),
        _ => None,
    }
}

fn crate_names() -> BTreeSet<String> {
    std::fs::read_dir(root().join("functions"))
        .unwrap()
        .map(|e| e.unwrap().path().join("Cargo.toml"))
        .filter(|p| p.exists())
        .map(|p| {
            let manifest: toml::Table =
                toml::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            manifest["package"]["name"].as_str().unwrap().to_owned()
        })
        .collect()
}

#[test]
fn every_function_crate_is_deployed_and_every_deployed_function_has_a_crate() {
    let t = template();
    let mut deployed = BTreeSet::new();
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        assert_eq!(
            f["Metadata"]["BuildMethod"].as_str(),
            Some("rust-cargolambda"),
            "{name}"
        );
        let binary = f["Metadata"]["BuildProperties"]["Binary"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no Binary"));
        assert!(
            deployed.insert(binary.to_owned()),
            "{binary} deployed twice"
        );
    }
    assert_eq!(
        deployed,
        crate_names(),
        "template functions and functions/ crates must match"
    );
    let globals = &t["Globals"]["Function"];
    assert_eq!(globals["Runtime"].as_str(), Some("provided.al2023"));
    assert_eq!(globals["Architectures"][0].as_str(), Some("arm64"));
}

#[test]
fn every_function_logs_with_retention_and_is_watched_for_errors_and_throttles() {
    let t = template();
    let alarms = of_type(&t, "AWS::CloudWatch::Alarm");
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        let group = reference(&f["Properties"]["LoggingConfig"]["LogGroup"])
            .unwrap_or_else(|| panic!("{name}: no log group"));
        let retention = &t["Resources"][group.as_str()]["Properties"]["RetentionInDays"];
        assert_eq!(
            reference(retention).as_deref(),
            Some("LogRetentionDays"),
            "{name}: log retention"
        );
        for metric in ["Errors", "Throttles"] {
            let watched = alarms.iter().any(|(_, a)| {
                let p = &a["Properties"];
                p["Namespace"].as_str() == Some("AWS/Lambda")
                    && p["MetricName"].as_str() == Some(metric)
                    && p["Dimensions"].as_sequence().is_some_and(|d| {
                        d.iter()
                            .any(|d| reference(&d["Value"]).as_deref() == Some(name.as_str()))
                    })
            });
            assert!(watched, "{name} has no {metric} alarm");
        }
    }
}

#[test]
fn every_alarm_watches_a_metric_that_exists() {
    let t = template();
    let ours: BTreeSet<&str> = shared::metrics::EMITTED.iter().copied().collect();
    for (name, alarm) in of_type(&t, "AWS::CloudWatch::Alarm") {
        let p = &alarm["Properties"];
        let metric = p["MetricName"].as_str().unwrap();
        match p["Namespace"].as_str().unwrap() {
            ns if ns == shared::metrics::NAMESPACE => assert!(
                ours.contains(metric),
                "{name}: {metric} is not emitted by the code"
            ),
            "AWS/Lambda" => assert!(["Errors", "Throttles"].contains(&metric), "{name}"),
            "AWS/ApiGateway" => assert!(
                ["5xx", "4xx", "Count", "Latency"].contains(&metric),
                "{name}"
            ),
            "AWS/SQS" => assert_eq!(metric, "ApproximateNumberOfMessagesVisible", "{name}"),
            other => panic!("{name}: unexpected namespace {other}"),
        }
        let actions = p["AlarmActions"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{name}: no actions"));
        assert!(!actions.is_empty(), "{name} notifies nobody");
    }
    // The queue alarms the issue asks for exist.
    let metrics: BTreeSet<String> = of_type(&t, "AWS::CloudWatch::Alarm")
        .iter()
        .filter_map(|(_, a)| a["Properties"]["MetricName"].as_str().map(str::to_owned))
        .collect();
    for needed in [
        shared::metrics::OLDEST_PENDING_AGE,
        shared::metrics::BACKLOG,
        "5xx",
    ] {
        assert!(metrics.contains(needed), "no alarm on {needed}");
    }
}

/// The metric names in one flush of the EMF exporter, each checked to carry a value.
fn flushed(collector: &shared::metrics::Collector) -> BTreeSet<String> {
    let mut out = Vec::new();
    collector.flush(&mut out).unwrap();
    let mut names = BTreeSet::new();
    for line in String::from_utf8(out).unwrap().lines() {
        let doc: serde_json::Value = serde_json::from_str(line).unwrap();
        let directive = &doc["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], shared::metrics::NAMESPACE);
        for m in directive["Metrics"].as_array().unwrap() {
            let name = m["Name"].as_str().unwrap().to_owned();
            let value = &doc[&name];
            assert!(
                value.is_number()
                    || value
                        .as_array()
                        .is_some_and(|v| v.iter().all(|x| x.is_number())),
                "{name} has a value in the document: {value}"
            );
            names.insert(name);
        }
    }
    names
}

/// Every documented metric is emitted; and a measurement is sent only by the invocation that
/// measured it: a later flush, or a drain pass that failed, sends no stale Backlog,
/// OldestPendingAgeSeconds or AnomalyBreaches for the alarms to mistake for health.
#[tokio::test]
async fn the_code_emits_the_documented_metrics_and_never_repeats_a_stale_measurement() {
    let collector = shared::metrics::install_emf().unwrap();
    shared::metrics::delivery_stored("accepted");
    shared::metrics::delivery_refused("signature");
    shared::metrics::drained(&shared::drain::DrainOutcome {
        processed: 3,
        retried: 1,
        dead_lettered: 1,
        ..Default::default()
    });
    shared::metrics::queue(12, 4.5);
    shared::metrics::anomaly_value("backlog_events", 12.0);
    shared::metrics::anomaly_breaches(0);
    let documented: BTreeSet<String> = shared::metrics::EMITTED
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(flushed(collector), documented);

    // The next invocation measured nothing: nothing is sent.
    assert_eq!(flushed(collector), BTreeSet::new());

    // A drain pass whose database is gone fails, and reports no queue.
    let unreachable = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/gone")
        .unwrap();
    let drainer = shared::drain::Drainer::new(
        unreachable,
        std::sync::Arc::new(shared::effects::EffectRegistry::standard()),
        shared::drain::DrainSettings::default(),
    );
    let failed = drainer
        .drain_until(std::time::Instant::now() + std::time::Duration::from_secs(5))
        .await;
    assert!(failed.is_err());
    let after_failure = flushed(collector);
    for stale in [
        shared::metrics::BACKLOG,
        shared::metrics::OLDEST_PENDING_AGE,
        shared::metrics::ANOMALY_BREACHES,
    ] {
        assert!(
            !after_failure.contains(stale),
            "{stale} re-sent: {after_failure:?}"
        );
    }
}

#[test]
fn the_migrations_resource_tracks_the_newest_migration() {
    let newest = std::fs::read_dir(root().join("migrations"))
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_str()
                .and_then(|n| n.split('_').next().map(str::to_owned))
        })
        .max()
        .unwrap();
    let t = template();
    let version = t["Resources"]["SchemaMigrations"]["Properties"]["SchemaVersion"]
        .as_str()
        .unwrap();
    assert_eq!(
        version, newest,
        "bump SchemaVersion in template.yaml so deploys run the new migration"
    );
}

#[test]
fn no_iam_statement_grants_a_wildcard_action() {
    let t = template();
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        for policy in f["Properties"]["Policies"]
            .as_sequence()
            .into_iter()
            .flatten()
        {
            for statement in policy["Statement"].as_sequence().into_iter().flatten() {
                for action in statement["Action"].as_sequence().into_iter().flatten() {
                    let action = action.as_str().unwrap();
                    assert!(!action.contains('*'), "{name}: wildcard action {action}");
                }
                assert!(
                    statement["Resource"].as_str() != Some("*"),
                    "{name}: wildcard resource"
                );
            }
        }
    }
}

#[test]
fn scheduled_functions_have_schedules_and_failure_destinations_and_reconcile_hears_the_alarms() {
    let t = template();
    for function in [
        "DrainFunction",
        "OutboxFunction",
        "ReconcileFunction",
        "BackfillFunction",
        "RetentionFunction",
        "AnomalyFunction",
    ] {
        let p = &t["Resources"][function]["Properties"];
        let events = p["Events"].as_mapping().unwrap();
        assert!(
            events
                .values()
                .any(|e| e["Type"].as_str() == Some("Schedule")),
            "{function}: no schedule"
        );
        assert!(
            p["EventInvokeConfig"]["DestinationConfig"]["OnFailure"]["Type"].as_str()
                == Some("SQS"),
            "{function}: no on-failure destination"
        );
    }
    let events = t["Resources"]["ReconcileFunction"]["Properties"]["Events"]
        .as_mapping()
        .unwrap();
    assert!(events.values().any(|e| e["Type"].as_str() == Some("SNS")
        && reference(&e["Properties"]["Topic"]).as_deref() == Some("AlarmTopic")));
}

#[test]
fn the_dashboard_body_is_valid_json() {
    let t = template();
    let Value::Tagged(body) = &t["Resources"]["PipelineDashboard"]["Properties"]["DashboardBody"]
    else {
        panic!("DashboardBody is not !Sub")
    };
    let mut text = body.value.as_str().unwrap().to_owned();
    while let Some(start) = text.find("${") {
        let end = start + text[start..].find('}').unwrap();
        text.replace_range(start..=end, "x");
    }
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(parsed["widgets"].as_array().unwrap().len() >= 4);
}
