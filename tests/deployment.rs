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

/// `!GetAtt X.Attr` → ("X", "Attr").
fn get_att(v: &Value) -> Option<(String, String)> {
    match v {
        Value::Tagged(t) if t.tag == "GetAtt" => t
            .value
            .as_str()
            .and_then(|s| s.split_once('.'))
            .map(|(r, a)| (r.to_owned(), a.to_owned())),
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
    assert_eq!(
        reference(&globals["Architectures"][0]).as_deref(),
        Some("Architecture")
    );
    assert_eq!(
        t["Parameters"]["Architecture"]["Default"].as_str(),
        Some("arm64")
    );
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
        let read = metrics_read(p);
        assert!(!read.is_empty(), "{name} reads no metric");
        for m in read {
            let metric = m["MetricName"].as_str().unwrap();
            match m["Namespace"].as_str().unwrap() {
                ns if ns == shared::metrics::NAMESPACE => assert!(
                    ours.contains(metric),
                    "{name}: {metric} is not emitted by the code"
                ),
                "AWS/Lambda" => assert!(
                    ["Errors", "Throttles", "Invocations"].contains(&metric),
                    "{name}"
                ),
                "AWS/ApiGateway" => assert!(
                    ["5xx", "4xx", "Count", "Latency"].contains(&metric),
                    "{name}"
                ),
                "AWS/SQS" => {
                    assert!(
                        [
                            "NumberOfMessagesSent",
                            "ApproximateAgeOfOldestMessage",
                            "ApproximateNumberOfMessagesVisible",
                        ]
                        .contains(&metric),
                        "{name}: {metric}"
                    );
                    // Of a queue of this stack.
                    let queue = m["Dimensions"]
                        .as_sequence()
                        .and_then(|d| d.iter().find(|d| d["Name"].as_str() == Some("QueueName")))
                        .and_then(|d| get_att(&d["Value"]))
                        .and_then(|(queue, attribute)| (attribute == "QueueName").then_some(queue))
                        .unwrap_or_else(|| panic!("{name}: no QueueName of a stack queue"));
                    assert_eq!(
                        t["Resources"][queue.as_str()]["Type"].as_str(),
                        Some("AWS::SQS::Queue"),
                        "{name}"
                    );
                }
                other => panic!("{name}: unexpected namespace {other}"),
            }
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

/// The metrics an alarm reads: its own (`Namespace`, `MetricName`, `Dimensions`), or each
/// `MetricStat` of a metric math alarm.
fn metrics_read(p: &Value) -> Vec<Value> {
    match p["Metrics"].as_sequence() {
        Some(queries) => queries
            .iter()
            .filter(|q| !q["MetricStat"].is_null())
            .map(|q| q["MetricStat"]["Metric"].clone())
            .collect(),
        None => vec![p.clone()],
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
    shared::metrics::delivery_buffered("spillover");
    shared::metrics::buffered_filed("stored");
    shared::metrics::stale_served("source");
    shared::metrics::buffer_send_failed("spillover");
    shared::metrics::ingest_5xx();
    shared::metrics::drained(3, 1, 1);
    shared::metrics::queue(12, 4.5);
    shared::metrics::anomaly_value("backlog_events", 12.0);
    shared::metrics::anomaly_breaches(0);
    shared::metrics::reconcile_repairs(&[("missing_effect", 2)]);
    shared::metrics::outbox(3, 250.0);
    // Issue 24.
    shared::metrics::outbox_delivery("sqs", "delivered", 2);
    // Issue 50.
    shared::metrics::outside_provider_ranges("observe");
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

    // A 5xx answer of version 7 is counted for every version and for version 7: the canary's
    // alarm reads both.
    shared::metrics::ingest_5xx_of(Some("7"));
    let mut out = Vec::new();
    collector.flush(&mut out).unwrap();
    let mut counted = BTreeSet::new();
    for line in String::from_utf8(out).unwrap().lines() {
        let doc: serde_json::Value = serde_json::from_str(line).unwrap();
        let dimensions = &doc["_aws"]["CloudWatchMetrics"][0]["Dimensions"];
        if doc[shared::metrics::INGEST_5XX] == 1 {
            counted.insert((
                dimensions.to_string(),
                doc[shared::metrics::FUNCTION_VERSION].to_string(),
            ));
        }
    }
    assert!(
        counted.contains(&(r#"[["FunctionVersion"]]"#.to_owned(), r#""7""#.to_owned())),
        "{counted:?}"
    );
    assert!(
        counted.iter().any(|(_, v)| v == "null"),
        "no count for every version: {counted:?}"
    );
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

/// Actions AWS authorizes on no resource but "*" (no resource-level permission exists): the
/// only statements that may name "*", and only with these actions alone.
const ONLY_ON_ANY_RESOURCE: &[&str] = &["cloudwatch:GetMetricData"];

/// A function's policies, each `!If [condition, policy, AWS::NoValue]` read as the policy it
/// grants when the condition holds (issue 24: the outbox's destinations are optional).
fn policies_of(f: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for policy in f["Properties"]["Policies"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        match tagged(policy) {
            Some((tag, branches)) if tag == "If" => {
                let branches = branches.as_sequence().unwrap();
                out.extend(
                    branches[1..]
                        .iter()
                        .filter(|b| b.as_mapping().is_some())
                        .cloned(),
                );
            }
            _ => out.push(policy.clone()),
        }
    }
    out
}

#[test]
fn no_iam_statement_grants_a_wildcard_action() {
    let t = template();
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        for policy in &policies_of(&f) {
            for statement in policy["Statement"].as_sequence().into_iter().flatten() {
                for action in statement["Action"].as_sequence().into_iter().flatten() {
                    let action = action.as_str().unwrap();
                    assert!(!action.contains('*'), "{name}: wildcard action {action}");
                }
                assert!(
                    statement["Resource"].as_str() != Some("*")
                        || actions(statement)
                            .iter()
                            .all(|a| ONLY_ON_ANY_RESOURCE.contains(&a.as_str())),
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

/// `!Sub`, `!If` and friends, as the tag's name and value.
fn tagged(v: &Value) -> Option<(String, &Value)> {
    match v {
        Value::Tagged(t) => Some((
            t.tag.to_string().trim_start_matches('!').to_owned(),
            &t.value,
        )),
        _ => None,
    }
}

fn functions_with_events(t: &Value) -> Vec<(String, Value)> {
    of_type(t, "AWS::Serverless::Function")
        .into_iter()
        .filter(|(_, f)| f["Properties"]["Events"].as_mapping().is_some())
        .collect()
}

/// Nothing can invoke a function before the schema it needs exists, and the migrations run
/// only once the functions may reach the database; CloudFormation's wait for the migrations'
/// answer is bounded by ServiceTimeout, above the function's own timeout.
#[test]
fn functions_with_triggers_wait_for_the_schema_and_the_schema_for_the_network() {
    let t = template();
    for (name, f) in functions_with_events(&t) {
        assert_eq!(
            f["DependsOn"].as_str(),
            Some("SchemaMigrations"),
            "{name} can be invoked before the migrations ran"
        );
    }
    let migrations = &t["Resources"]["SchemaMigrations"];
    assert_eq!(
        migrations["DependsOn"].as_str(),
        Some("DatabaseIngressFromFunctions")
    );
    let service_timeout = migrations["Properties"]["ServiceTimeout"].as_u64().unwrap();
    let migrate_timeout = t["Resources"]["MigrateFunction"]["Properties"]["Timeout"]
        .as_u64()
        .unwrap();
    assert!(
        migrate_timeout < service_timeout && service_timeout < 3600,
        "ServiceTimeout {service_timeout} s against a {migrate_timeout} s function"
    );
    // The function keeps ANSWER_MARGIN of its timeout to answer in.
    assert!(migrate::ANSWER_MARGIN.as_secs() < migrate_timeout);
}

/// CloudWatch cannot publish to a topic under the AWS-managed alias/aws/sns: every alarm
/// topic is under a key whose policy lets cloudwatch.amazonaws.com use it.
#[test]
fn alarm_topics_are_encrypted_with_a_key_cloudwatch_may_use() {
    let t = template();
    let topics = of_type(&t, "AWS::SNS::Topic");
    assert!(!topics.is_empty());
    for (name, topic) in topics {
        let key = reference(&topic["Properties"]["KmsMasterKeyId"])
            .unwrap_or_else(|| panic!("{name}: not under a key of the stack's own"));
        let key = &t["Resources"][key.as_str()];
        assert_eq!(key["Type"].as_str(), Some("AWS::KMS::Key"), "{name}");
        let cloudwatch_may_publish = key["Properties"]["KeyPolicy"]["Statement"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|s| {
                let actions: Vec<&str> = s["Action"]
                    .as_sequence()
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                s["Effect"].as_str() == Some("Allow")
                    && s["Principal"]["Service"].as_str() == Some("cloudwatch.amazonaws.com")
                    && actions.contains(&"kms:Decrypt")
                    && actions.contains(&"kms:GenerateDataKey*")
            });
        assert!(
            cloudwatch_may_publish,
            "{name}: CloudWatch cannot use its key"
        );
    }
    // Every alarm action goes to one of these topics.
    for (name, alarm) in of_type(&t, "AWS::CloudWatch::Alarm") {
        for action in alarm["Properties"]["AlarmActions"].as_sequence().unwrap() {
            let topic = reference(action).unwrap_or_else(|| panic!("{name}: {action:?}"));
            assert_eq!(
                t["Resources"][topic.as_str()]["Type"].as_str(),
                Some("AWS::SNS::Topic"),
                "{name}"
            );
        }
    }
}

/// `rate(5 minutes)` → 300.
fn rate_seconds(schedule: &str) -> u64 {
    let inner = schedule
        .strip_prefix("rate(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{schedule} is not a rate"));
    let (n, unit) = inner.split_once(' ').unwrap();
    let n: u64 = n.parse().unwrap();
    n * match unit.trim_end_matches('s') {
        "minute" => 60,
        "hour" => 3600,
        "day" => 86400,
        other => panic!("unit {other}"),
    }
}

/// The functions that stay in their minute for new work (the drain and the outbox): each
/// invocation runs to its deadline, and the next starts a few seconds before it ends, so no
/// minute has a gap in which an event waits for the schedule. Two of them overlap harmlessly:
/// SKIP LOCKED keeps drainers apart, leases keep senders apart.
const STAYING: [&str; 2] = ["DrainFunction", "OutboxFunction"];

/// A run that outlasts its schedule overlaps the next one, which then throttles (or waits on
/// the lock and records skipped): every scheduled function ends before it is due again, but
/// the two that stay for new work, which end within ten seconds of the next start and know
/// their own timeout (`FUNCTION_TIMEOUT_SECONDS`).
#[test]
fn every_scheduled_function_times_out_before_its_next_run() {
    let t = template();
    let default_timeout = t["Globals"]["Function"]["Timeout"].as_u64().unwrap();
    for (name, f) in functions_with_events(&t) {
        let timeout = f["Properties"]["Timeout"]
            .as_u64()
            .unwrap_or(default_timeout);
        for event in f["Properties"]["Events"].as_mapping().unwrap().values() {
            if event["Type"].as_str() == Some("Schedule") {
                let every = rate_seconds(event["Properties"]["Schedule"].as_str().unwrap());
                if STAYING.contains(&name.as_str()) {
                    assert!(
                        every < timeout && timeout <= every + 10,
                        "{name}: timeout {timeout} s, scheduled every {every} s: it overlaps the next run by at most ten seconds"
                    );
                    assert_eq!(
                        f["Properties"]["Environment"]["Variables"]["FUNCTION_TIMEOUT_SECONDS"]
                            .as_str(),
                        Some(timeout.to_string().as_str()),
                        "{name}"
                    );
                } else {
                    assert!(
                        timeout < every,
                        "{name}: timeout {timeout} s, scheduled every {every} s"
                    );
                }
            }
        }
    }
    // The drain's reservation, when set, leaves room for two: a rule refuses one.
    let (tag, assertion) =
        tagged(&t["Rules"]["DrainReservationLeavesRoomForTheOverlap"]["Assertions"][0]["Assert"])
            .unwrap();
    assert_eq!(tag, "Not");
    let (tag, equals) = tagged(&assertion[0]).unwrap();
    assert_eq!(tag, "Equals");
    assert_eq!(
        (reference(&equals[0]).as_deref(), equals[1].as_str()),
        (Some("DrainReservedConcurrency"), Some("1"))
    );
}

/// X-Ray on every function; the ingest function deploys as a canary that its own 5xx and
/// error alarms roll back; the endpoint is throttled at the stage.
#[test]
fn tracing_canary_deployment_and_stage_throttling() {
    let t = template();
    assert_eq!(t["Globals"]["Function"]["Tracing"].as_str(), Some("Active"));
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        assert!(
            f["Properties"]["Tracing"].is_null(),
            "{name} overrides tracing"
        );
    }
    let ingest = &t["Resources"]["IngestFunction"]["Properties"];
    assert_eq!(ingest["AutoPublishAlias"].as_str(), Some("live"));
    let preference = &ingest["DeploymentPreference"];
    assert!(
        preference["Type"]
            .as_str()
            .is_some_and(|s| s.starts_with("Canary")),
        "{preference:?}"
    );
    let guarded: BTreeSet<String> = preference["Alarms"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(reference)
        .collect();
    for alarm in ["Ingest5xxAlarm", "IngestErrorsAlarm"] {
        assert!(guarded.contains(alarm), "the canary ignores {alarm}");
        assert_eq!(
            t["Resources"][alarm]["Type"].as_str(),
            Some("AWS::CloudWatch::Alarm")
        );
    }
    let throttling = &t["Resources"]["WebhookApi"]["Properties"]["DefaultRouteSettings"];
    assert!(reference(&throttling["ThrottlingRateLimit"]).is_some());
    assert!(reference(&throttling["ThrottlingBurstLimit"]).is_some());
}

/// A new account has a concurrency quota of 10 or 50, and Lambda keeps 100 unreserved: with
/// its defaults the stack reserves nothing, and every reservation is a parameter.
#[test]
fn the_default_stack_reserves_no_concurrency() {
    let t = template();
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        let reserved = &f["Properties"]["ReservedConcurrentExecutions"];
        if reserved.is_null() {
            continue;
        }
        let (tag, value) = tagged(reserved).unwrap_or_else(|| panic!("{name}: fixed reservation"));
        assert_eq!(tag, "If", "{name}");
        let parameter = reference(&value[1]).unwrap();
        assert_eq!(
            t["Parameters"][parameter.as_str()]["Default"].as_u64(),
            Some(0),
            "{name}: {parameter} reserves concurrency by default"
        );
    }
}

/// Secrets under a customer-managed key can be read: every function that reads a secret gets
/// kms:Decrypt on the keys of `SecretsKmsKeyArns`, through Secrets Manager only.
#[test]
fn every_function_may_decrypt_secrets_under_the_given_keys() {
    let t = template();
    let policy = &t["Resources"]["SecretsKeyDecryptPolicy"];
    assert_eq!(policy["Condition"].as_str(), Some("HasSecretsKmsKeys"));
    let statement = &policy["Properties"]["PolicyDocument"]["Statement"][0];
    assert_eq!(
        reference(&statement["Resource"]).as_deref(),
        Some("SecretsKmsKeyArns")
    );
    assert!(
        tagged(&statement["Condition"]["StringEquals"]["kms:ViaService"]).is_some(),
        "decrypt only via Secrets Manager"
    );
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        let attached = f["Properties"]["Policies"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter_map(tagged)
            .any(|(tag, v)| {
                tag == "If" && reference(&v[1]).as_deref() == Some("SecretsKeyDecryptPolicy")
            });
        assert!(attached, "{name} cannot decrypt a CMK-encrypted secret");
    }
}

/// samconfig: no cached builds (SAM hashes target/ while cargo rewrites it), no blanket beta
/// flag (SAM CLI 1.170 builds rust-cargolambda without one); SAM's build folder is ignored.
#[test]
fn sam_builds_are_not_cached_and_need_no_beta_features() {
    let config: toml::Table =
        toml::from_str(&std::fs::read_to_string(root().join("samconfig.toml")).unwrap()).unwrap();
    for (env, sections) in &config {
        let Some(sections) = sections.as_table() else {
            continue;
        };
        for (command, section) in sections {
            let parameters = &section["parameters"];
            assert_ne!(
                parameters.get("cached").and_then(toml::Value::as_bool),
                Some(true),
                "{env}.{command}: cached builds"
            );
            assert!(
                parameters.get("beta_features").is_none(),
                "{env}.{command}: beta_features"
            );
        }
    }
    let ignored = std::fs::read_to_string(root().join(".gitignore")).unwrap();
    assert!(ignored.lines().any(|l| l.trim_matches('/') == ".aws-sam"));
}

/// The alarm table ("Alarms and what to do" in docs/operating.md) names every alarm the stack
/// defines.
#[test]
fn the_alarm_table_documents_every_alarm() {
    let page = std::fs::read_to_string(root().join("docs/operating.md")).unwrap();
    let heading = "\n## Alarms and what to do\n";
    let start = page
        .find(heading)
        .expect("docs/operating.md has a section \"Alarms and what to do\"");
    let section = &page[start + heading.len()..];
    let table = &section[..section.find("\n## ").unwrap_or(section.len())];
    let t = template();
    for (name, alarm) in of_type(&t, "AWS::CloudWatch::Alarm") {
        let (_, sub) = tagged(&alarm["Properties"]["AlarmName"]).unwrap();
        let suffix = sub
            .as_str()
            .unwrap()
            .strip_prefix("${AWS::StackName}-")
            .unwrap();
        let documented = table.contains(&format!("`{suffix}`"))
            || suffix
                .rsplit_once('-')
                .is_some_and(|(_, kind)| table.contains(&format!("`<function>-{kind}`")));
        assert!(
            documented,
            "{name} ({suffix}) is not in the alarm table of docs/operating.md"
        );
    }
}

/// Every function is told its own timeout (its sessions' timeouts derive from it) and where the
/// database is when the secret does not say (RDS's managed master-user secret holds only the
/// user name and password).
#[test]
fn every_function_knows_its_deadline_and_where_the_database_is() {
    let t = template();
    let default_timeout = t["Globals"]["Function"]["Timeout"].as_u64().unwrap();
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        let timeout = f["Properties"]["Timeout"]
            .as_u64()
            .unwrap_or(default_timeout);
        let told = &f["Properties"]["Environment"]["Variables"]["FUNCTION_TIMEOUT_SECONDS"];
        assert_eq!(
            told.as_str(),
            Some(timeout.to_string().as_str()),
            "{name}: FUNCTION_TIMEOUT_SECONDS against a Timeout of {timeout} s"
        );
    }
    let globals = &t["Globals"]["Function"]["Environment"]["Variables"];
    for var in [
        "DATABASE_SECRET_ID",
        "DATABASE_HOST",
        "DATABASE_PORT",
        "DATABASE_NAME",
    ] {
        assert!(!globals[var].is_null(), "Globals do not set {var}");
    }
    for parameter in ["DatabaseHost", "DatabasePort", "DatabaseName"] {
        assert!(
            !t["Parameters"][parameter].is_null(),
            "no {parameter} parameter"
        );
    }
}

/// The operator function's resource policy names who may invoke it: one grant per principal
/// of the `OperatorPrincipals` parameter (the stack's own account when it is empty), each for
/// lambda:InvokeFunction only, and no other permission on the function.
#[test]
fn the_operator_function_may_be_invoked_by_the_named_principals_only() {
    let t = template();
    let parameter = &t["Parameters"]["OperatorPrincipals"];
    assert_eq!(parameter["Type"].as_str(), Some("CommaDelimitedList"));
    assert_eq!(parameter["Default"].as_str(), Some(""));
    let grants: Vec<(String, Value)> = of_type(&t, "AWS::Lambda::Permission")
        .into_iter()
        .filter(|(_, p)| {
            reference(&p["Properties"]["FunctionName"]).as_deref() == Some("OperatorFunction")
        })
        .collect();
    assert!(
        !grants.is_empty(),
        "no resource policy on the operator function"
    );
    for (name, grant) in &grants {
        let properties = &grant["Properties"];
        assert_eq!(
            properties["Action"].as_str(),
            Some("lambda:InvokeFunction"),
            "{name}"
        );
        assert!(
            format!("{:?}", properties["Principal"]).contains("OperatorPrincipals"),
            "{name}: the principal comes from OperatorPrincipals: {:?}",
            properties["Principal"]
        );
    }
    // The first grant always exists (the account itself by default); the others only when the
    // list names that many.
    let unconditional = grants
        .iter()
        .filter(|(_, g)| g["Condition"].as_str().is_none())
        .count();
    assert_eq!(unconditional, 1, "{grants:?}");
    for (name, grant) in grants.iter().filter(|(_, g)| g["Condition"].is_string()) {
        let condition = grant["Condition"].as_str().unwrap();
        assert!(
            !t["Conditions"][condition].is_null(),
            "{name}: condition {condition} is defined"
        );
    }
}

/// `!GetAtt IngestFunction.Version.Version`: the version this deployment published.
fn is_new_version(v: &Value) -> bool {
    matches!(v, Value::Tagged(t) if t.tag == "GetAtt"
        && t.value.as_str() == Some("IngestFunction.Version.Version"))
}

/// Whether a metric an alarm reads is the new version's alone: Lambda's `ExecutedVersion` or
/// the code's `FunctionVersion`, naming the version this deployment published.
fn of_new_version(metric: &Value) -> bool {
    metric["Dimensions"].as_sequence().is_some_and(|dims| {
        dims.iter().any(|d| {
            matches!(
                d["Name"].as_str(),
                Some("ExecutedVersion") | Some(shared::metrics::FUNCTION_VERSION)
            ) && is_new_version(&d["Value"])
        })
    })
}

/// A CloudWatch metric math expression over one datapoint per metric: numbers, ids, `+ - * /`,
/// `>`, `FILL(x, v)` and `IF(c, a, b)`. `None` is a missing datapoint.
struct Expr<'a> {
    text: &'a [u8],
    at: usize,
    values: &'a std::collections::BTreeMap<String, Option<f64>>,
}

impl Expr<'_> {
    fn skip(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        self.skip();
        if self.text.get(self.at) == Some(&c) {
            self.at += 1;
            true
        } else {
            false
        }
    }
    fn comparison(&mut self) -> Option<f64> {
        let left = self.sum();
        if self.eat(b'>') {
            let right = self.sum();
            return Some(f64::from(u8::from(left? > right?)));
        }
        left
    }
    fn sum(&mut self) -> Option<f64> {
        let mut value = self.product();
        loop {
            if self.eat(b'+') {
                let r = self.product();
                value = value.zip(r).map(|(a, b)| a + b);
            } else if self.eat(b'-') {
                let r = self.product();
                value = value.zip(r).map(|(a, b)| a - b);
            } else {
                return value;
            }
        }
    }
    fn product(&mut self) -> Option<f64> {
        let mut value = self.atom();
        loop {
            if self.eat(b'*') {
                let r = self.atom();
                value = value.zip(r).map(|(a, b)| a * b);
            } else if self.eat(b'/') {
                let r = self.atom();
                value = value.zip(r).map(|(a, b)| a / b);
            } else {
                return value;
            }
        }
    }
    fn atom(&mut self) -> Option<f64> {
        if self.eat(b'(') {
            let v = self.comparison();
            assert!(self.eat(b')'));
            return v;
        }
        self.skip();
        let start = self.at;
        while self
            .text
            .get(self.at)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'.')
        {
            self.at += 1;
        }
        let word = std::str::from_utf8(&self.text[start..self.at]).unwrap();
        assert!(!word.is_empty(), "expression syntax at {}", self.at);
        if let Ok(n) = word.parse::<f64>() {
            return Some(n);
        }
        if self.eat(b'(') {
            let mut args = vec![self.comparison()];
            while self.eat(b',') {
                args.push(self.comparison());
            }
            assert!(self.eat(b')'));
            return match (word, args.as_slice()) {
                ("FILL", [x, v]) => x.or(*v),
                ("IF", [c, a, b]) => c.and_then(|c| if c != 0.0 { *a } else { *b }),
                other => panic!("unsupported function {other:?}"),
            };
        }
        *self
            .values
            .get(word)
            .unwrap_or_else(|| panic!("unknown id {word}"))
    }
}

/// One minute of ingest traffic: the new version's and every version's 5xx answers, failed
/// invocations and invocations.
#[derive(Clone, Copy)]
struct Minute {
    new: (u32, u32, u32),
    all: (u32, u32, u32),
}

/// Whether `alarm` breaches over `minute`, missing data treated as the alarm says.
fn breaches(alarm: &Value, minute: Minute) -> bool {
    let p = &alarm["Properties"];
    let datapoint = |metric: &Value| -> Option<f64> {
        let (failed, errors, invocations) = if of_new_version(metric) {
            minute.new
        } else {
            minute.all
        };
        let n = match metric["MetricName"].as_str().unwrap() {
            "Ingest5xx" => failed,
            "Errors" => errors,
            "Invocations" => invocations,
            other => panic!("the canary reads {other}"),
        };
        // CloudWatch has no datapoint for a metric nobody emitted in the minute.
        (n > 0).then_some(f64::from(n))
    };
    let value = match p["Metrics"].as_sequence() {
        None => datapoint(p),
        Some(queries) => {
            let mut values = std::collections::BTreeMap::new();
            let mut returned = None;
            for q in queries {
                let id = q["Id"].as_str().unwrap().to_owned();
                let v = if q["MetricStat"].is_null() {
                    let text = q["Expression"].as_str().unwrap();
                    let mut e = Expr {
                        text: text.as_bytes(),
                        at: 0,
                        values: &values,
                    };
                    let v = e.comparison();
                    e.skip();
                    assert_eq!(e.at, text.len(), "unparsed: {text}");
                    v
                } else {
                    datapoint(&q["MetricStat"]["Metric"])
                };
                if q["ReturnData"].as_bool() == Some(true) {
                    assert!(returned.is_none(), "one returned series");
                    returned = Some(id.clone());
                }
                values.insert(id, v);
            }
            values[&returned.expect("a returned series")]
        }
    };
    assert_eq!(p["TreatMissingData"].as_str(), Some("notBreaching"));
    assert_eq!(
        p["ComparisonOperator"].as_str(),
        Some("GreaterThanThreshold")
    );
    assert_eq!(
        p["EvaluationPeriods"].as_u64(),
        Some(1),
        "one minute decides"
    );
    let threshold = p["Threshold"].as_f64().unwrap();
    value.is_some_and(|v| v > threshold)
}

/// The alarms that roll back an ingest deployment watch the version being deployed: each reads
/// metrics of the new version (Lambda's ExecutedVersion, the code's FunctionVersion), one
/// failed delivery on the new version at low traffic trips one of them (a handler's 5xx answer
/// as well as a crashed invocation), and an outage that fails every version alike does not
/// roll back good code.
#[test]
fn the_canary_watches_the_new_version() {
    let t = template();
    let preference = &t["Resources"]["IngestFunction"]["Properties"]["DeploymentPreference"];
    let alarms: Vec<Value> = preference["Alarms"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| t["Resources"][reference(a).unwrap().as_str()].clone())
        .collect();
    assert!(!alarms.is_empty());
    for alarm in &alarms {
        let read = metrics_read(&alarm["Properties"]);
        assert!(
            read.iter().any(of_new_version),
            "{:?} does not watch the new version",
            alarm["Properties"]["AlarmName"]
        );
        for metric in &read {
            if metric["Namespace"].as_str() == Some("AWS/Lambda") {
                let dims = metric["Dimensions"].as_sequence().unwrap();
                assert!(
                    dims.iter()
                        .any(|d| d["Name"].as_str() == Some("FunctionName")
                            && reference(&d["Value"]).as_deref() == Some("IngestFunction")),
                    "{metric:?}"
                );
            }
        }
    }
    let rolled_back = |minute: Minute| alarms.iter().any(|a| breaches(a, minute));
    let quiet = Minute {
        new: (0, 0, 0),
        all: (0, 0, 0),
    };
    let cases = [
        // (what happened in the minute, rolled back)
        ("no traffic", quiet, false),
        (
            "one delivery, to the new version, answered 5xx",
            Minute {
                new: (1, 0, 1),
                all: (1, 0, 1),
            },
            true,
        ),
        (
            "the new version's one delivery answered 5xx, the old version's nine answered",
            Minute {
                new: (1, 0, 1),
                all: (1, 0, 10),
            },
            true,
        ),
        (
            "the new version's one invocation crashed",
            Minute {
                new: (0, 1, 1),
                all: (0, 1, 10),
            },
            true,
        ),
        (
            "the new version fails every request at 100 a minute, the old none",
            Minute {
                new: (10, 0, 10),
                all: (10, 0, 100),
            },
            true,
        ),
        (
            "healthy traffic on both versions",
            Minute {
                new: (0, 0, 10),
                all: (0, 0, 100),
            },
            false,
        ),
        (
            "a database blip answers 503 on both versions alike",
            Minute {
                new: (10, 0, 10),
                all: (100, 0, 100),
            },
            false,
        ),
        (
            "the old version answers 5xx, the new one does not",
            Minute {
                new: (0, 0, 10),
                all: (30, 0, 100),
            },
            false,
        ),
    ];
    for (what, minute, expected) in cases {
        assert_eq!(rolled_back(minute), expected, "{what}");
    }
}

/// API Gateway answers a throttled Lambda invocation with a 5xx, not 429 (429 is the stage's own
/// throttling): the template says so where it describes an ingest throttle.
#[test]
fn an_ingest_throttle_is_described_as_a_5xx() {
    let t = template();
    let description = t["Resources"]["IngestThrottlesAlarm"]["Properties"]["AlarmDescription"]
        .as_str()
        .unwrap();
    assert!(description.contains("5xx"), "{description}");
    assert!(
        !description.contains("get 429"),
        "a throttled invocation is not a 429: {description}"
    );
}

/// The workspace's crates, by manifest.
fn manifests() -> Vec<(String, toml::Table)> {
    let workspace: toml::Table =
        toml::from_str(&std::fs::read_to_string(root().join("Cargo.toml")).unwrap()).unwrap();
    workspace["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let path = root().join(m.as_str().unwrap()).join("Cargo.toml");
            let manifest = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            (m.as_str().unwrap().to_owned(), manifest)
        })
        .collect()
}

/// The features a manifest's tables give `dependency`.
fn features_of(manifest: &toml::Table, dependency: &str) -> BTreeSet<String> {
    ["dependencies", "dev-dependencies", "build-dependencies"]
        .iter()
        .filter_map(|table| manifest.get(*table)?.get(dependency))
        .flat_map(|d| d.get("features").and_then(toml::Value::as_array).cloned())
        .flatten()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect()
}

/// The ingest function takes the HTTP API's payload (format 2.0) and lambda_http parses only
/// that shape: with several enabled it tries each in turn (a REST API event first), and cargo
/// gives every binary of a build the features any crate in it enables, so no crate of the
/// workspace enables another shape, and the workspace dependency none at all.
#[test]
fn ingest_parses_only_the_http_api_payload() {
    let t = template();
    let events = t["Resources"]["IngestFunction"]["Properties"]["Events"]
        .as_mapping()
        .unwrap();
    for event in events.values() {
        assert_eq!(event["Type"].as_str(), Some("HttpApi"));
        let format = &event["Properties"]["PayloadFormatVersion"];
        assert!(
            format.is_null() || format.as_str() == Some("2.0"),
            "{format:?}"
        );
    }
    let workspace: toml::Table =
        toml::from_str(&std::fs::read_to_string(root().join("Cargo.toml")).unwrap()).unwrap();
    let shared_dependency = &workspace["workspace"]["dependencies"]["lambda_http"];
    assert_eq!(
        shared_dependency
            .get("default-features")
            .and_then(toml::Value::as_bool),
        Some(false)
    );
    assert!(
        shared_dependency
            .get("features")
            .and_then(toml::Value::as_array)
            .is_none_or(|f| f.is_empty()),
        "the workspace's lambda_http enables {shared_dependency:?}"
    );
    for (member, manifest) in manifests() {
        let features = features_of(&manifest, "lambda_http");
        assert!(
            features.iter().all(|f| f == "apigw_http"),
            "{member} enables lambda_http {features:?}"
        );
    }
    let ingest = manifests()
        .into_iter()
        .find(|(m, _)| m == "functions/ingest")
        .unwrap()
        .1;
    assert_eq!(
        features_of(&ingest, "lambda_http"),
        BTreeSet::from(["apigw_http".to_owned()])
    );
}

// ---- The SQS buffer (issue 21) ------------------------------------------------------------

/// The queue an IAM or policy `Resource` names, by logical id: `!GetAtt Q.Arn`, or the ARN
/// spelled out from the queue's `QueueName` (the roles' policies spell it: the key's policy
/// names the roles, so a reference would be a cycle). A spelled ARN that drifted from the
/// queue's name names no queue.
fn queue_named_by(t: &Value, resource: &Value) -> Option<String> {
    if let Some((queue, attribute)) = get_att(resource) {
        return (attribute == "Arn").then_some(queue);
    }
    let (tag, arn) = tagged(resource)?;
    if tag != "Sub" {
        return None;
    }
    let arn = arn.as_str()?;
    of_type(t, "AWS::SQS::Queue")
        .into_iter()
        .find(|(_, q)| {
            tagged(&q["Properties"]["QueueName"])
                .and_then(|(tag, name)| (tag == "Sub").then(|| name.as_str().map(str::to_owned)))
                .flatten()
                .is_some_and(|name| {
                    arn == format!(
                        "arn:${{AWS::Partition}}:sqs:${{AWS::Region}}:${{AWS::AccountId}}:{name}"
                    )
                })
        })
        .map(|(name, _)| name)
}

/// A statement's `Action` (one string or a list) as strings.
fn actions(statement: &Value) -> Vec<String> {
    match &statement["Action"] {
        Value::String(a) => vec![a.clone()],
        Value::Sequence(a) => a.iter().map(|a| a.as_str().unwrap().to_owned()).collect(),
        other => panic!("Action {other:?}"),
    }
}

/// A statement's `Resource` (one or a list).
fn statement_resources(statement: &Value) -> Vec<Value> {
    match &statement["Resource"] {
        Value::Sequence(r) => r.clone(),
        Value::Null => vec![],
        r => vec![r.clone()],
    }
}

/// The functions whose own IAM statements allow `action` on `queue`.
fn functions_allowed(t: &Value, action: &str, queue: &str) -> BTreeSet<String> {
    let mut allowed = BTreeSet::new();
    for (name, f) in of_type(t, "AWS::Serverless::Function") {
        for policy in &policies_of(&f) {
            for statement in policy["Statement"].as_sequence().into_iter().flatten() {
                if statement["Effect"].as_str() == Some("Allow")
                    && actions(statement).iter().any(|a| a == action)
                    && statement_resources(statement)
                        .iter()
                        .any(|r| queue_named_by(t, r).as_deref() == Some(queue))
                {
                    allowed.insert(name.clone());
                }
            }
        }
    }
    allowed
}

/// The functions whose roles a deny's `ArnNotEquals aws:PrincipalArn` exempts: the only
/// principals the statement lets through.
fn exempted_functions(statement: &Value) -> BTreeSet<String> {
    let exempt = &statement["Condition"]["ArnNotEquals"]["aws:PrincipalArn"];
    let exempt = match exempt {
        Value::Sequence(list) => list.clone(),
        Value::Null => panic!("a deny without a principal exemption: {statement:?}"),
        one => vec![one.clone()],
    };
    exempt
        .iter()
        .map(|role| {
            let (role, attribute) = get_att(role).unwrap_or_else(|| panic!("{role:?}"));
            assert_eq!(attribute, "Arn");
            role.strip_suffix("Role")
                .unwrap_or_else(|| panic!("{role} is not a function's role"))
                .to_owned()
        })
        .collect()
}

/// The statements of the queue policy on `queue`.
fn queue_policy(t: &Value, queue: &str) -> Vec<Value> {
    let policies: Vec<(String, Value)> = of_type(t, "AWS::SQS::QueuePolicy")
        .into_iter()
        .filter(|(_, p)| {
            p["Properties"]["Queues"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|q| reference(q).as_deref() == Some(queue))
        })
        .collect();
    assert_eq!(policies.len(), 1, "one queue policy on {queue}");
    policies[0].1["Properties"]["PolicyDocument"]["Statement"]
        .as_sequence()
        .unwrap()
        .clone()
}

/// The deny of a queue policy covering `action`, apart from the TLS one.
fn deny_of<'a>(statements: &'a [Value], action: &str) -> &'a Value {
    let denies: Vec<&Value> = statements
        .iter()
        .filter(|s| {
            s["Effect"].as_str() == Some("Deny")
                && s["Condition"]["Bool"]["aws:SecureTransport"].is_null()
                && actions(s).iter().any(|a| a == action)
        })
        .collect();
    assert_eq!(denies.len(), 1, "one deny of {action}: {denies:?}");
    denies[0]
}

/// The buffer and its dead-letter queue are encrypted under the stack's own rotating key, keep
/// a message the 14 days SQS allows at most, take the largest message ingest sends, and a
/// message received 5 times unfiled moves to the dead-letter queue, which takes redrives from
/// the buffer only.
#[test]
fn the_buffer_is_encrypted_kept_14_days_and_dead_letters_after_five_receives() {
    let t = template();
    let key = &t["Resources"]["BufferKey"];
    assert_eq!(key["Type"].as_str(), Some("AWS::KMS::Key"));
    assert_eq!(key["Properties"]["EnableKeyRotation"].as_bool(), Some(true));
    let alias = &t["Resources"]["BufferKeyAlias"];
    assert_eq!(alias["Type"].as_str(), Some("AWS::KMS::Alias"));
    assert_eq!(
        reference(&alias["Properties"]["TargetKeyId"]).as_deref(),
        Some("BufferKey")
    );
    for queue in ["BufferQueue", "BufferDeadLetterQueue"] {
        let q = &t["Resources"][queue];
        assert_eq!(q["Type"].as_str(), Some("AWS::SQS::Queue"), "{queue}");
        let p = &q["Properties"];
        assert_eq!(
            reference(&p["KmsMasterKeyId"]).as_deref(),
            Some("BufferKey"),
            "{queue}: encrypted with the buffer's key"
        );
        assert!(p["SqsManagedSseEnabled"].is_null(), "{queue}");
        let reuse = p["KmsDataKeyReusePeriodSeconds"].as_u64().unwrap();
        assert!((60..=86400).contains(&reuse), "{queue}: reuse {reuse}");
        assert_eq!(
            p["MessageRetentionPeriod"].as_u64(),
            Some(1_209_600),
            "{queue}: 14 days"
        );
        assert_eq!(
            p["MaximumMessageSize"].as_u64(),
            Some(shared::buffer::SQS_MAX_MESSAGE_BYTES as u64),
            "{queue}: takes every message ingest sends"
        );
    }
    let redrive = &t["Resources"]["BufferQueue"]["Properties"]["RedrivePolicy"];
    assert_eq!(
        get_att(&redrive["deadLetterTargetArn"]),
        Some(("BufferDeadLetterQueue".to_owned(), "Arn".to_owned()))
    );
    assert_eq!(redrive["maxReceiveCount"].as_u64(), Some(5));
    let allow = &t["Resources"]["BufferDeadLetterQueue"]["Properties"]["RedriveAllowPolicy"];
    assert_eq!(allow["redrivePermission"].as_str(), Some("byQueue"));
    let sources: Vec<Option<String>> = allow["sourceQueueArns"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| queue_named_by(&t, a))
        .collect();
    assert_eq!(sources, vec![Some("BufferQueue".to_owned())]);
}

/// AWS requires the queue's visibility timeout to be at least the function's timeout and
/// advises 6 ×; a message gathered in a batching window is already in flight, so the longest
/// window the parameter allows comes on top.
#[test]
fn the_buffer_hides_a_message_longer_than_its_consumer_can_hold_it() {
    let t = template();
    let timeout = t["Resources"]["BufferFunction"]["Properties"]["Timeout"]
        .as_u64()
        .unwrap();
    let window = t["Parameters"]["BufferBatchingWindowSeconds"]["MaxValue"]
        .as_u64()
        .unwrap();
    let visibility = t["Resources"]["BufferQueue"]["Properties"]["VisibilityTimeout"]
        .as_u64()
        .unwrap();
    assert!(
        visibility >= 6 * timeout + window,
        "visibility {visibility} s against a {timeout} s consumer and a {window} s window"
    );
    assert!(visibility <= 43_200, "SQS's maximum is 12 hours");
}

/// The buffer function files from the buffer on an event source mapping whose batch size,
/// batching window and maximum concurrency are the parameters, within what AWS accepts (a batch
/// above 10 needs a window: a rule refuses the combination before AWS does), and reports the
/// messages it could not file one by one.
#[test]
fn the_buffer_function_is_mapped_to_the_buffer_with_batch_item_failures() {
    let t = template();
    let f = &t["Resources"]["BufferFunction"];
    assert_eq!(
        f["Metadata"]["BuildProperties"]["Binary"].as_str(),
        Some("buffer")
    );
    let events: Vec<&Value> = f["Properties"]["Events"]
        .as_mapping()
        .unwrap()
        .values()
        .collect();
    assert_eq!(events.len(), 1);
    let event = events[0];
    assert_eq!(event["Type"].as_str(), Some("SQS"));
    let p = &event["Properties"];
    assert_eq!(
        get_att(&p["Queue"]),
        Some(("BufferQueue".to_owned(), "Arn".to_owned()))
    );
    assert_eq!(
        reference(&p["BatchSize"]).as_deref(),
        Some("BufferBatchSize")
    );
    assert_eq!(
        reference(&p["MaximumBatchingWindowInSeconds"]).as_deref(),
        Some("BufferBatchingWindowSeconds")
    );
    assert_eq!(
        reference(&p["ScalingConfig"]["MaximumConcurrency"]).as_deref(),
        Some("BufferMaximumConcurrency")
    );
    let response_types: Vec<&str> = p["FunctionResponseTypes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(response_types, ["ReportBatchItemFailures"]);

    for (parameter, min, max, default) in [
        ("BufferBatchSize", 1, 10_000, 100),
        ("BufferBatchingWindowSeconds", 0, 300, 1),
        ("BufferMaximumConcurrency", 2, 1000, 5),
    ] {
        let p = &t["Parameters"][parameter];
        assert_eq!(p["Type"].as_str(), Some("Number"), "{parameter}");
        assert_eq!(p["MinValue"].as_u64(), Some(min), "{parameter}");
        assert_eq!(p["MaxValue"].as_u64(), Some(max), "{parameter}");
        assert_eq!(p["Default"].as_u64(), Some(default), "{parameter}");
        assert!(p["Description"].as_str().is_some(), "{parameter}");
    }
    // The defaults satisfy AWS: a batch above 10 has a window.
    assert!(t["Parameters"]["BufferBatchingWindowSeconds"]["Default"].as_u64() >= Some(1));

    // The rule: with no window, the batch size is one of 1..=10.
    let rule = &t["Rules"]["BufferBatchAboveTenNeedsABatchingWindow"];
    let (tag, condition) = tagged(&rule["RuleCondition"]).unwrap();
    assert_eq!(tag, "Equals");
    assert_eq!(
        reference(&condition[0]).as_deref(),
        Some("BufferBatchingWindowSeconds")
    );
    assert_eq!(condition[1].as_str(), Some("0"));
    let (tag, assertion) = tagged(&rule["Assertions"][0]["Assert"]).unwrap();
    assert_eq!(tag, "Contains");
    let allowed: Vec<&str> = assertion[0]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let one_to_ten: Vec<String> = (1..=10).map(|n| n.to_string()).collect();
    assert_eq!(allowed, one_to_ten);
    assert_eq!(reference(&assertion[1]).as_deref(), Some("BufferBatchSize"));
}

/// Only ingest (and the operator, redriving) may send to the buffer, and only the buffer
/// function may receive, delete or hide its messages; only the operator reads the dead letters.
/// Both the roles' own policies and the queue policies say so (a deny for everyone else,
/// whatever their IAM allows), on data-plane actions only so that the account keeps managing
/// the queues; both queues refuse plain HTTP. The key lets exactly those roles use it, through
/// SQS only.
#[test]
fn only_ingest_sends_to_the_buffer_and_only_the_buffer_function_receives() {
    let t = template();
    let set =
        |names: &[&str]| -> BTreeSet<String> { names.iter().map(|s| s.to_string()).collect() };
    let senders = set(&["IngestFunction", "OperatorFunction"]);
    let consumer = set(&["BufferFunction"]);
    let operator = set(&["OperatorFunction"]);

    // The roles' policies.
    assert_eq!(
        functions_allowed(&t, "sqs:SendMessage", "BufferQueue"),
        senders
    );
    for action in [
        "sqs:ReceiveMessage",
        "sqs:DeleteMessage",
        "sqs:ChangeMessageVisibility",
    ] {
        assert_eq!(
            functions_allowed(&t, action, "BufferQueue"),
            consumer,
            "{action}"
        );
        assert_eq!(
            functions_allowed(&t, action, "BufferDeadLetterQueue"),
            operator,
            "{action} on the dead letters"
        );
    }
    assert!(functions_allowed(&t, "sqs:SendMessage", "BufferDeadLetterQueue").is_empty());
    for function in ["BufferFunction", "OperatorFunction", "BackfillFunction"] {
        assert!(
            functions_allowed(&t, "sqs:GetQueueAttributes", "BufferQueue").contains(function),
            "{function} cannot read the buffer's depth"
        );
    }
    // The buffer's depth is both queues' counts (BufferQueue::depth reads the dead-letter queue
    // too): a function given both URLs must read both, or in AWS every count is AccessDenied
    // and the buffer "cannot be counted" for good.
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        let env = &f["Properties"]["Environment"]["Variables"];
        if reference(&env["BUFFER_DEAD_LETTER_QUEUE_URL"]).is_none() {
            continue;
        }
        for queue in ["BufferQueue", "BufferDeadLetterQueue"] {
            assert!(
                functions_allowed(&t, "sqs:GetQueueAttributes", queue).contains(&name),
                "{name} is given BUFFER_DEAD_LETTER_QUEUE_URL but cannot count {queue}"
            );
        }
    }
    // The oldest buffered message's age is CloudWatch's; only the operator (status), the
    // anomaly pass (silence) and backfill (gaps) read it, and only that (GetMetricData has no resource-level
    // permission: "*" is all AWS accepts).
    let metric_readers: BTreeSet<String> = of_type(&t, "AWS::Serverless::Function")
        .into_iter()
        .filter(|(_, f)| {
            f["Properties"]["Policies"]
                .as_sequence()
                .into_iter()
                .flatten()
                .flat_map(|p| p["Statement"].as_sequence().into_iter().flatten())
                .any(|s| {
                    s["Effect"].as_str() == Some("Allow")
                        && actions(s).iter().any(|a| a.starts_with("cloudwatch:"))
                })
        })
        .map(|(name, _)| name.clone())
        .collect();
    assert_eq!(
        metric_readers,
        set(&["AnomalyFunction", "BackfillFunction", "OperatorFunction"]),
        "who reads CloudWatch"
    );
    for reader in &metric_readers {
        let cloudwatch: Vec<String> = t["Resources"][reader]["Properties"]["Policies"]
            .as_sequence()
            .unwrap()
            .iter()
            .flat_map(|p| p["Statement"].as_sequence().into_iter().flatten())
            .flat_map(actions)
            .filter(|a| a.starts_with("cloudwatch:"))
            .collect();
        assert_eq!(cloudwatch, ["cloudwatch:GetMetricData"], "{reader}");
    }

    // The queue policies.
    let data_plane = [
        "sqs:SendMessage",
        "sqs:ReceiveMessage",
        "sqs:DeleteMessage",
        "sqs:ChangeMessageVisibility",
    ];
    for (queue, exemptions) in [
        (
            "BufferQueue",
            vec![
                ("sqs:SendMessage", senders.clone()),
                ("sqs:ReceiveMessage", consumer.clone()),
                ("sqs:DeleteMessage", consumer.clone()),
                ("sqs:ChangeMessageVisibility", consumer.clone()),
            ],
        ),
        (
            "BufferDeadLetterQueue",
            vec![
                ("sqs:ReceiveMessage", operator.clone()),
                ("sqs:DeleteMessage", operator.clone()),
                ("sqs:ChangeMessageVisibility", operator.clone()),
            ],
        ),
    ] {
        let statements = queue_policy(&t, queue);
        for (action, exempt) in exemptions {
            let deny = deny_of(&statements, action);
            assert_eq!(deny["Principal"].as_str(), Some("*"), "{queue} {action}");
            assert_eq!(
                exempted_functions(deny),
                exempt,
                "{queue}: who may {action}"
            );
        }
        for statement in &statements {
            assert_eq!(
                statement["Effect"].as_str(),
                Some("Deny"),
                "{queue}: {statement:?}"
            );
            assert_eq!(
                statement_resources(statement)
                    .iter()
                    .map(|r| queue_named_by(&t, r))
                    .collect::<Vec<_>>(),
                vec![Some(queue.to_owned())],
                "{queue}: a statement about another resource"
            );
            if statement["Condition"]["Bool"]["aws:SecureTransport"].is_null() {
                for action in actions(statement) {
                    assert!(
                        data_plane.contains(&action.as_str()),
                        "{queue}: denying {action} could lock the account out of managing it"
                    );
                }
            }
        }
        let tls_only = statements.iter().any(|s| {
            s["Effect"].as_str() == Some("Deny")
                && s["Condition"]["Bool"]["aws:SecureTransport"].as_str() == Some("false")
                && actions(s) == ["sqs:*"]
        });
        assert!(tls_only, "{queue} admits plain HTTP");
    }

    // The key's policy: the account administers; each role of a function that uses the
    // buffer, through SQS only, with what it needs.
    let statements = t["Resources"]["BufferKey"]["Properties"]["KeyPolicy"]["Statement"]
        .as_sequence()
        .unwrap()
        .clone();
    let mut granted = std::collections::BTreeMap::new();
    for s in &statements {
        assert_eq!(s["Effect"].as_str(), Some("Allow"));
        let principal = &s["Principal"]["AWS"];
        if let Some((tag, root)) = tagged(principal).filter(|(tag, _)| tag == "Sub") {
            assert_eq!(tag, "Sub");
            assert!(root.as_str().unwrap().ends_with(":root"));
            continue;
        }
        let (role, _) = get_att(principal).unwrap_or_else(|| panic!("{principal:?}"));
        let via = &s["Condition"]["StringEquals"]["kms:ViaService"];
        let (_, via) = tagged(via).unwrap_or_else(|| panic!("{role}: not only through SQS"));
        assert!(via.as_str().unwrap().starts_with("sqs."), "{role}: {via:?}");
        let mut actions = actions(s);
        actions.sort();
        granted.insert(role, actions);
    }
    let both = vec!["kms:Decrypt".to_owned(), "kms:GenerateDataKey".to_owned()];
    assert_eq!(
        granted,
        std::collections::BTreeMap::from([
            ("IngestFunctionRole".to_owned(), both.clone()),
            ("OperatorFunctionRole".to_owned(), both),
            (
                "BufferFunctionRole".to_owned(),
                vec!["kms:Decrypt".to_owned()]
            ),
        ])
    );
}

/// The two buffer alarms the issue asks for: the age of the oldest buffered delivery against
/// its parameter, and any message in the dead-letter queue; both notify the alarm topic.
#[test]
fn the_buffer_alarms_watch_the_oldest_message_and_the_dead_letters() {
    let t = template();
    for (alarm, metric, queue, period) in [
        (
            "BufferOldestMessageAgeAlarm",
            "ApproximateAgeOfOldestMessage",
            "BufferQueue",
            300,
        ),
        (
            "BufferDeadLettersAlarm",
            "ApproximateNumberOfMessagesVisible",
            "BufferDeadLetterQueue",
            300,
        ),
    ] {
        let a = &t["Resources"][alarm];
        assert_eq!(
            a["Type"].as_str(),
            Some("AWS::CloudWatch::Alarm"),
            "{alarm}"
        );
        let p = &a["Properties"];
        assert_eq!(p["Namespace"].as_str(), Some("AWS/SQS"), "{alarm}");
        assert_eq!(p["MetricName"].as_str(), Some(metric), "{alarm}");
        assert_eq!(
            get_att(&p["Dimensions"][0]["Value"]),
            Some((queue.to_owned(), "QueueName".to_owned())),
            "{alarm}"
        );
        assert_eq!(p["Dimensions"][0]["Name"].as_str(), Some("QueueName"));
        assert_eq!(p["Period"].as_u64(), Some(period), "{alarm}");
        assert_eq!(
            p["TreatMissingData"].as_str(),
            Some("notBreaching"),
            "{alarm}"
        );
        let actions: Vec<Option<String>> = p["AlarmActions"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(reference)
            .collect();
        assert_eq!(actions, vec![Some("AlarmTopic".to_owned())], "{alarm}");
    }
    let age = &t["Resources"]["BufferOldestMessageAgeAlarm"]["Properties"];
    assert_eq!(
        reference(&age["Threshold"]).as_deref(),
        Some("BufferOldestAgeThresholdSeconds")
    );
    assert_eq!(
        age["ComparisonOperator"].as_str(),
        Some("GreaterThanOrEqualToThreshold")
    );
    assert_eq!(
        t["Parameters"]["BufferOldestAgeThresholdSeconds"]["Default"].as_u64(),
        Some(300)
    );
    let dead = &t["Resources"]["BufferDeadLettersAlarm"]["Properties"];
    assert_eq!(dead["Threshold"].as_f64(), Some(0.0));
    assert_eq!(
        dead["ComparisonOperator"].as_str(),
        Some("GreaterThanThreshold")
    );
}

/// Ingest is told its buffer mode (spillover by default, one of exactly the three modes) and
/// the queue, and spills well inside its own timeout; the operator and backfill are told both
/// queues; the stack outputs them.
#[test]
fn ingest_knows_its_buffer_mode_and_queue() {
    let t = template();
    let mode = &t["Parameters"]["BufferMode"];
    assert_eq!(mode["Type"].as_str(), Some("String"));
    assert_eq!(mode["Default"].as_str(), Some("spillover"));
    let allowed: BTreeSet<&str> = mode["AllowedValues"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(allowed, BTreeSet::from(["database", "spillover", "queue"]));
    assert_eq!(mode["AllowedValues"].as_sequence().unwrap().len(), 3);

    let ingest = &t["Resources"]["IngestFunction"]["Properties"];
    let env = &ingest["Environment"]["Variables"];
    assert_eq!(
        reference(&env["BUFFER_MODE"]).as_deref(),
        Some("BufferMode")
    );
    assert_eq!(
        reference(&env["BUFFER_QUEUE_URL"]).as_deref(),
        Some("BufferQueue")
    );
    let spill_ms: u64 = env["SPILLOVER_AFTER_MS"].as_str().unwrap().parse().unwrap();
    let timeout_ms = ingest["Timeout"].as_u64().unwrap() * 1000;
    assert!(
        spill_ms > 0 && 2 * spill_ms <= timeout_ms,
        "spilling after {spill_ms} ms leaves too little of {timeout_ms} ms to send"
    );
    for function in ["OperatorFunction", "BackfillFunction", "AnomalyFunction"] {
        let env = &t["Resources"][function]["Properties"]["Environment"]["Variables"];
        assert_eq!(
            reference(&env["BUFFER_QUEUE_URL"]).as_deref(),
            Some("BufferQueue"),
            "{function}"
        );
        assert_eq!(
            reference(&env["BUFFER_DEAD_LETTER_QUEUE_URL"]).as_deref(),
            Some("BufferDeadLetterQueue"),
            "{function}"
        );
    }
    for (output, queue) in [
        ("BufferQueueUrl", "BufferQueue"),
        ("BufferDeadLetterQueueUrl", "BufferDeadLetterQueue"),
    ] {
        assert_eq!(
            reference(&t["Outputs"][output]["Value"]).as_deref(),
            Some(queue)
        );
    }
}

/// The optional SQS interface endpoint: only when asked for, with private DNS (so the queue
/// URLs resolve to it), admitting HTTPS from the functions only.
#[test]
fn the_sqs_endpoint_is_optional_private_and_admits_the_functions_only() {
    let t = template();
    let parameter = &t["Parameters"]["CreateSqsEndpoint"];
    assert_eq!(parameter["Default"].as_str(), Some("false"));
    let endpoint = &t["Resources"]["SqsEndpoint"];
    let condition = endpoint["Condition"].as_str().unwrap();
    let (tag, equals) = tagged(&t["Conditions"][condition]).unwrap();
    assert_eq!(tag, "Equals");
    assert_eq!(reference(&equals[0]).as_deref(), Some("CreateSqsEndpoint"));
    assert_eq!(equals[1].as_str(), Some("true"));
    let p = &endpoint["Properties"];
    assert_eq!(p["VpcEndpointType"].as_str(), Some("Interface"));
    assert_eq!(p["PrivateDnsEnabled"].as_bool(), Some(true));
    let (_, service) = tagged(&p["ServiceName"]).unwrap();
    assert!(service.as_str().unwrap().ends_with(".sqs"));
    assert_eq!(reference(&p["SubnetIds"]).as_deref(), Some("SubnetIds"));
    let group = reference(&p["SecurityGroupIds"][0]).unwrap();
    let group = &t["Resources"][group.as_str()];
    assert_eq!(group["Condition"].as_str(), Some(condition));
    let ingress = group["Properties"]["SecurityGroupIngress"]
        .as_sequence()
        .unwrap();
    assert_eq!(ingress.len(), 1);
    assert_eq!(ingress[0]["FromPort"].as_u64(), Some(443));
    assert_eq!(ingress[0]["ToPort"].as_u64(), Some(443));
    assert_eq!(
        reference(&ingress[0]["SourceSecurityGroupId"]).as_deref(),
        Some("FunctionSecurityGroup")
    );
}

/// Issue 23: a repair, delayed outbox deliveries and a spill to the buffer each page on-call
/// through the on-call-only topic (the alarm topic also invokes reconcile, which has nothing to
/// do for any of them), and the outbox alarm's limit is the check's.
#[test]
fn repairs_delayed_deliveries_and_spills_page_on_call_without_invoking_reconcile() {
    let t = template();
    let alarm = |suffix: &str| -> Value {
        of_type(&t, "AWS::CloudWatch::Alarm")
            .into_iter()
            .find(|(_, a)| {
                tagged(&a["Properties"]["AlarmName"])
                    .and_then(|(_, sub)| sub.as_str().map(str::to_owned))
                    .is_some_and(|name| name == format!("${{AWS::StackName}}-{suffix}"))
            })
            .map(|(_, a)| a["Properties"].clone())
            .unwrap_or_else(|| panic!("no alarm {suffix}"))
    };
    for (suffix, metric, threshold) in [
        ("reconcile-repairs", shared::metrics::RECONCILE_REPAIRS, 0.0),
        (
            "outbox-delivery-delayed",
            shared::metrics::OUTBOX_OLDEST_UNDELIVERED_AGE,
            shared::store::anomaly::OUTBOX_OLDEST_UNDELIVERED_LIMIT_SECONDS,
        ),
        (
            "buffer-spillover",
            shared::metrics::DELIVERIES_BUFFERED,
            0.0,
        ),
    ] {
        let p = alarm(suffix);
        assert_eq!(p["MetricName"].as_str(), Some(metric), "{suffix}");
        assert_eq!(p["Threshold"].as_f64(), Some(threshold), "{suffix}");
        assert_eq!(
            p["ComparisonOperator"].as_str(),
            Some("GreaterThanThreshold"),
            "{suffix}"
        );
        for actions in ["AlarmActions", "OKActions"] {
            let topics: Vec<Option<String>> = p[actions]
                .as_sequence()
                .unwrap_or_else(|| panic!("{suffix}: no {actions}"))
                .iter()
                .map(reference)
                .collect();
            assert_eq!(
                topics,
                vec![Some("OnCallOnlyTopic".to_owned())],
                "{suffix}: {actions}"
            );
        }
    }
    // The repairs alarm reads the total, not one kind; the spill alarm spillover only.
    assert!(alarm("reconcile-repairs")["Dimensions"].is_null());
    let spill = alarm("buffer-spillover");
    let dimensions = spill["Dimensions"].as_sequence().unwrap();
    assert_eq!(dimensions.len(), 1);
    assert_eq!(dimensions[0]["Name"].as_str(), Some("Mode"));
    assert_eq!(dimensions[0]["Value"].as_str(), Some("spillover"));
    // The on-call-only topic reaches no function.
    for (name, function) in functions_with_events(&t) {
        for (_, e) in function["Properties"]["Events"].as_mapping().unwrap() {
            assert_ne!(
                reference(&e["Properties"]["Topic"]).as_deref(),
                Some("OnCallOnlyTopic"),
                "{name}"
            );
        }
    }
    // The repairs check breaches without invoking reconcile through anomaly-breaches.
    assert!(shared::anomaly::ON_CALL_ONLY.contains(&"reconcile_repairs_last_day"));
}

// Issue 24: the outbox's destinations.

/// (condition, statement) of each statement a function's policies grant under a condition
/// (`!If [condition, {Statement: ...}, AWS::NoValue]`).
fn conditional_statements(f: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for policy in f["Properties"]["Policies"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        if let Some((tag, branches)) = tagged(policy)
            && tag == "If"
        {
            let branches = branches.as_sequence().unwrap();
            let condition = branches[0].as_str().unwrap().to_owned();
            assert!(
                reference(&branches[2]).as_deref() == Some("AWS::NoValue"),
                "{condition}: a policy granted when the condition fails"
            );
            // A managed policy's reference (`SecretsKeyDecryptPolicy`) holds no statement here.
            for statement in branches[1]["Statement"].as_sequence().into_iter().flatten() {
                out.push((condition.clone(), statement.clone()));
            }
        }
    }
    out
}

/// The outbox may put events on, send to and publish to exactly the buses, queues and topics
/// its parameters name (no wildcard, no other resource), each only when some are named, and
/// their keys through SQS and SNS only; no other function may reach them.
#[test]
fn the_outbox_reaches_exactly_the_destinations_its_parameters_name() {
    let t = template();
    let outbox = &t["Resources"]["OutboxFunction"];
    let granted = conditional_statements(outbox);
    let expected = [
        (
            "HasOutboxEventBuses",
            "events:PutEvents",
            "OutboxEventBusArns",
        ),
        ("HasOutboxQueues", "sqs:SendMessage", "OutboxQueueArns"),
        ("HasOutboxTopics", "sns:Publish", "OutboxTopicArns"),
    ];
    for (condition, action, parameter) in expected {
        let statements: Vec<&Value> = granted
            .iter()
            .filter(|(_, s)| actions(s).iter().any(|a| a == action))
            .map(|(c, s)| {
                assert_eq!(c, condition, "{action}");
                s
            })
            .collect();
        assert_eq!(statements.len(), 1, "one statement grants {action}");
        let s = statements[0];
        assert_eq!(actions(s), [action], "{action} alone");
        assert_eq!(
            reference(&s["Resource"]).as_deref(),
            Some(parameter),
            "{action} on exactly the {parameter}"
        );
        let p = &t["Parameters"][parameter];
        assert_eq!(
            (p["Type"].as_str(), p["Default"].as_str()),
            (Some("CommaDelimitedList"), Some("")),
            "{parameter} is an optional list"
        );
        let defined = &t["Conditions"][condition];
        assert!(
            format!("{defined:?}").contains(parameter),
            "{condition} is not defined by {parameter}: {defined:?}"
        );
    }
    let keys: Vec<&Value> = granted
        .iter()
        .filter(|(_, s)| actions(s).iter().any(|a| a.starts_with("kms:")))
        .map(|(c, s)| {
            assert_eq!(c, "HasOutboxDestinationKeys");
            s
        })
        .collect();
    assert_eq!(keys.len(), 1);
    assert_eq!(actions(keys[0]), ["kms:GenerateDataKey", "kms:Decrypt"]);
    assert_eq!(
        reference(&keys[0]["Resource"]).as_deref(),
        Some("OutboxDestinationKeyArns")
    );
    let via: Vec<String> = keys[0]["Condition"]["StringEquals"]["kms:ViaService"]
        .as_sequence()
        .expect("the keys are usable through SQS and SNS only")
        .iter()
        .map(|v| tagged(v).unwrap().1.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        via,
        [
            "sqs.${AWS::Region}.amazonaws.com",
            "sns.${AWS::Region}.amazonaws.com"
        ]
    );

    // Nobody else puts events or publishes, and nobody else sends to the routed queues.
    for (name, f) in of_type(&t, "AWS::Serverless::Function") {
        if name == "OutboxFunction" {
            continue;
        }
        for policy in &policies_of(&f) {
            for statement in policy["Statement"].as_sequence().into_iter().flatten() {
                let acts = actions(statement);
                assert!(
                    !acts
                        .iter()
                        .any(|a| a == "events:PutEvents" || a == "sns:Publish"),
                    "{name} may {acts:?}"
                );
                for parameter in ["OutboxEventBusArns", "OutboxQueueArns", "OutboxTopicArns"] {
                    assert_ne!(
                        reference(&statement["Resource"]).as_deref(),
                        Some(parameter),
                        "{name} reaches the outbox's destinations"
                    );
                }
            }
        }
    }
    // The outbox may still reach nothing else of AWS: its unconditional statements are the
    // database secret's read only.
    let unconditional: Vec<String> = outbox["Properties"]["Policies"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|p| p["Statement"].as_sequence().cloned().unwrap_or_default())
        .flat_map(|s| actions(&s))
        .collect();
    assert_eq!(unconditional, ["secretsmanager:GetSecretValue"]);
}

/// Each destination kind's messages failed for good raise their own alarm (AWS kinds only when
/// the stack names such destinations), messages no route covers one more, and the dashboard
/// graphs deliveries per kind.
#[test]
fn every_destination_kind_alarms_on_its_failures_and_is_on_the_dashboard() {
    use shared::outbox::destinations::Kind;
    let t = template();
    let alarms = of_type(&t, "AWS::CloudWatch::Alarm");
    let alarm_on = |destination: &str, outcome: &str| -> Vec<(String, Value)> {
        alarms
            .iter()
            .filter(|(_, a)| {
                let p = &a["Properties"];
                let dims: Vec<(String, String)> = p["Dimensions"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .map(|d| {
                        (
                            d["Name"].as_str().unwrap_or_default().to_owned(),
                            d["Value"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect();
                p["MetricName"].as_str() == Some(shared::metrics::OUTBOX_DELIVERIES)
                    && dims
                        == [
                            ("Destination".to_owned(), destination.to_owned()),
                            ("Outcome".to_owned(), outcome.to_owned()),
                        ]
            })
            .cloned()
            .collect()
    };
    for kind in Kind::ALL {
        let found = alarm_on(kind.as_str(), "failed");
        assert_eq!(found.len(), 1, "one alarm on {} failures", kind.as_str());
        let condition = found[0].1["Condition"].as_str();
        let expected = match kind {
            Kind::Http => None,
            Kind::EventBridge => Some("HasOutboxEventBuses"),
            Kind::Sqs => Some("HasOutboxQueues"),
            Kind::Sns => Some("HasOutboxTopics"),
        };
        assert_eq!(condition, expected, "{}", found[0].0);
        assert_eq!(found[0].1["Properties"]["Threshold"].as_f64(), Some(0.0));
    }
    assert_eq!(alarm_on("none", "unrouted").len(), 1);

    let (_, body) =
        tagged(&t["Resources"]["PipelineDashboard"]["Properties"]["DashboardBody"]).unwrap();
    let body = body.as_str().unwrap();
    for kind in Kind::ALL {
        assert!(
            body.contains(&format!(
                r#"["Webhooks", "OutboxDeliveries", "Destination", "{}", "Outcome", "delivered"]"#,
                kind.as_str()
            )),
            "the dashboard does not graph {} deliveries",
            kind.as_str()
        );
    }
}

/// Routes and subscriptions that sign their HTTP deliveries name a Secrets Manager secret: the
/// outbox may read those secrets (`OutboxSigningSecretArns`, an optional list) besides the
/// database's, read only, and nothing more when none is named; a CMK-encrypted one is
/// decrypted through the same policy as every other secret.
#[test]
fn the_outbox_reads_exactly_the_signing_secrets_its_parameter_names() {
    let t = template();
    let outbox = &t["Resources"]["OutboxFunction"];
    let reads: Vec<Value> = outbox["Properties"]["Policies"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|p| p["Statement"].as_sequence().cloned().unwrap_or_default())
        .filter(|s| actions(s).iter().any(|a| a.starts_with("secretsmanager:")))
        .collect();
    assert_eq!(reads.len(), 1, "one statement reads secrets");
    assert_eq!(actions(&reads[0]), ["secretsmanager:GetSecretValue"]);
    let (tag, branches) = tagged(&reads[0]["Resource"]).expect("a conditional resource");
    assert_eq!(tag, "If");
    let branches = branches.as_sequence().unwrap();
    assert_eq!(branches[0].as_str(), Some("HasOutboxSigningSecrets"));
    let named = format!("{:?}", branches[1]);
    assert!(
        named.contains("OutboxSigningSecretArns") && named.contains("DatabaseSecretArn"),
        "with signing secrets: the database's and those: {named}"
    );
    assert_eq!(
        reference(&branches[2]).as_deref(),
        Some("DatabaseSecretArn"),
        "without: the database's alone"
    );
    let p = &t["Parameters"]["OutboxSigningSecretArns"];
    assert_eq!(
        (p["Type"].as_str(), p["Default"].as_str()),
        (Some("CommaDelimitedList"), Some(""))
    );
    assert!(
        format!("{:?}", t["Conditions"]["HasOutboxSigningSecrets"])
            .contains("OutboxSigningSecretArns")
    );
}

/// API Gateway routes only the methods the stack names: a provider whose endpoint check comes
/// by another method than POST (Okta's GET, Mailchimp Transactional's HEAD) is never answered
/// unless ingest is routed that method too. Every method a catalogue handshake's known answer
/// uses is routed to ingest on `/webhooks/{source_id}`.
#[test]
fn every_method_a_provider_checks_its_endpoint_with_is_routed_to_ingest() {
    let t = template();
    let ingest = &t["Resources"]["IngestFunction"]["Properties"]["Events"];
    let routed: BTreeSet<String> = ingest
        .as_mapping()
        .expect("the ingest function's events")
        .values()
        .filter(|e| e["Type"].as_str() == Some("HttpApi"))
        .filter(|e| e["Properties"]["Path"].as_str() == Some("/webhooks/{source_id}"))
        .filter_map(|e| e["Properties"]["Method"].as_str().map(str::to_owned))
        .collect();
    let needed: BTreeSet<String> = shared::domain::Scheme::ALL
        .iter()
        .flat_map(|s| s.provider().handshake.vectors.iter())
        .map(|v| v.method.clone())
        .chain(["POST".to_owned()])
        .collect();
    assert!(
        needed.contains("HEAD") && needed.contains("GET"),
        "{needed:?}"
    );
    assert_eq!(
        routed, needed,
        "routed {routed:?}, the catalogue needs {needed:?}"
    );
}

/// A job's step (`run_job`, the console's and `hookctl dead-letters replay`'s) runs at most
/// `MAX_JOB_SECONDS`, and through `--function` each step is one Invoke of the operator
/// function: the step must end, and answer, before Lambda ends the function at its Timeout.
#[test]
fn a_job_step_ends_before_the_operator_function_times_out() {
    let t = template();
    let timeout = t["Resources"]["OperatorFunction"]["Properties"]["Timeout"]
        .as_u64()
        .unwrap();
    assert!(
        shared::operator::MAX_JOB_SECONDS * 2 <= timeout,
        "a {} s step in a {timeout} s function leaves too little to commit and answer",
        shared::operator::MAX_JOB_SECONDS
    );
}

/// The console says a gap asked to be backfilled now is fetched within
/// `BACKFILL_PASS_SECONDS`: the backfill function's schedule is that often.
#[test]
fn a_gap_asked_to_be_backfilled_now_is_fetched_within_the_pass_the_console_names() {
    let t = template();
    let events = t["Resources"]["BackfillFunction"]["Properties"]["Events"]
        .as_mapping()
        .unwrap();
    let schedules: Vec<&str> = events
        .values()
        .filter(|e| e["Type"] == "Schedule")
        .filter_map(|e| e["Properties"]["Schedule"].as_str())
        .collect();
    let expected = format!(
        "rate({} minutes)",
        shared::operator::BACKFILL_PASS_SECONDS / 60
    );
    assert_eq!(schedules, [expected.as_str()]);
}

/// Partners that do not sign get an API of their own, only behind the partner domain's mutual
/// TLS (its truststore the parameter), with no execute-api endpoint that would skip it, routed
/// to the same ingest alias; all of it only when PartnerDomainName is set. The providers' API
/// keeps its endpoint.
#[test]
fn partners_reach_ingest_only_through_the_mutual_tls_domain() {
    let t = template();
    let r = &t["Resources"];
    for name in [
        "PartnerApi",
        "PartnerIntegration",
        "PartnerRoute",
        "PartnerStage",
        "PartnerDomain",
        "PartnerApiMapping",
        "PartnerInvokePermission",
    ] {
        assert_eq!(r[name]["Condition"], "HasPartnerDomain", "{name}");
    }
    assert_eq!(
        r["PartnerApi"]["Properties"]["DisableExecuteApiEndpoint"],
        true
    );
    let tls = &r["PartnerDomain"]["Properties"]["MutualTlsAuthentication"];
    assert_eq!(
        reference(&tls["TruststoreUri"]).as_deref(),
        Some("PartnerTruststoreUri")
    );
    assert_eq!(
        r["PartnerRoute"]["Properties"]["RouteKey"],
        "POST /partners/{source_id}"
    );
    assert_eq!(
        reference(&r["PartnerIntegration"]["Properties"]["IntegrationUri"]).as_deref(),
        Some("IngestFunctionAliaslive"),
        "the alias the canary deploys"
    );
    assert_eq!(
        reference(&r["PartnerInvokePermission"]["Properties"]["FunctionName"]).as_deref(),
        Some("IngestFunctionAliaslive")
    );
    assert!(
        r["WebhookApi"]["Properties"]
            .get("DisableExecuteApiEndpoint")
            .is_none(),
        "the providers' endpoint is unchanged"
    );
    assert_eq!(t["Parameters"]["PartnerDomainName"]["Default"], "");
}
