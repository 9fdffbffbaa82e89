use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use hookctl::backend::Backend;
use hookctl::commands::{
    self, ActionsAction, BufferAction, ChecksAction, DeadLettersAction, GapsAction, OutboxAction,
    RunsAction, TombstonesAction,
};
use hookctl::{captured, drill, serve, verify};
use shared::config::{SecretsBackend, Vars};
use shared::domain::{Scheme, SourceId};
use shared::drain::Drainer;
use shared::effects::EffectRegistry;
use shared::ingest::{Ingestor, unix_now};
use shared::outbox::{OutboxSender, OutboxSettings};
use shared::secrets::{SecretSet, SecretStore, SigningSecret};
use shared::sources;
use shared::store::{self, MIGRATOR};

/// Webhook receiver: local runner and operator commands.
///
/// Database commands read DATABASE_URL. The operator's commands (status, dead-letters, outbox,
/// tombstones, gaps, runs, checks, actions, operator) answer either from DATABASE_URL or, with
/// --function, by invoking the deployed operator function (AWS credentials and region from the
/// environment, as for the AWS CLI). Exit codes: 0 all accounted for, 1 needs a human, 2 could
/// not tell (unreachable, bad arguments).
///
/// Secrets are read as the ingest function reads them (SECRETS_BACKEND=aws|file, SECRETS_FILE,
/// SECRETS_MANAGER_ENDPOINT) unless --secrets-file is given.
#[derive(Parser)]
#[command(name = "hookctl", version)]
struct Cli {
    /// Answer through the deployed operator function (name or ARN) instead of DATABASE_URL.
    #[arg(long, global = true, env = "HOOKCTL_FUNCTION")]
    function: Option<String>,
    /// Endpoint of the Lambda API (a VPC endpoint; default: AWS's for the region).
    #[arg(long, global = true, env = "HOOKCTL_LAMBDA_ENDPOINT")]
    lambda_endpoint: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the ingest function over HTTP on this machine (the local runner).
    Serve(ServeArgs),
    /// Serve the operator's console on 127.0.0.1 and print the URL to open (with a one-time
    /// token). Against DATABASE_URL, or the deployed operator function with --function.
    /// Read-only unless --write; every change is recorded with --actor (else the OS user).
    Console(ConsoleArgs),
    /// Apply the schema migrations to DATABASE_URL.
    Migrate,
    /// Add, change or list sources (no redeploy: ingest sees changes within its cache TTL).
    Sources {
        #[command(subcommand)]
        action: SourcesAction,
    },
    /// Validate, apply or list the outbox's routes: where each action of a tenant (or source)
    /// is delivered (HTTP, EventBridge, SQS, SNS). An apply replaces the whole set.
    Routes {
        #[command(subcommand)]
        action: RoutesAction,
    },
    /// Stored events: replay a range to a subscription, show one.
    Events {
        #[command(subcommand)]
        action: commands::EventsAction,
    },
    /// Check a captured delivery's signature and say exactly why it fails. Exit 0 valid, 1 not.
    Verify(VerifyArgs),
    /// Print the headers a provider would sign a body with (for curl and tests).
    Sign(SignArgs),
    /// The provider catalogue: list, show NAME, markdown (docs/providers.md).
    Providers {
        #[command(subcommand)]
        action: ProvidersAction,
    },
    /// Did we lose anything? The verdict, then per source, the queue, the maintenance passes.
    /// Exit 0 every event accounted for, 1 something needs a human, 2 could not tell.
    Status,
    /// Dead letters: list, show, replay, discard.
    DeadLetters {
        #[command(subcommand)]
        action: DeadLettersAction,
    },
    /// The SQS buffer: its dead letters (list, redrive: BUFFER_QUEUE_URL and
    /// BUFFER_DEAD_LETTER_QUEUE_URL, or --function), and file-kept: file a delivery an anomaly
    /// kept once its source reads it.
    Buffer {
        #[command(subcommand)]
        action: BufferAction,
    },
    /// Outbox messages that failed for good: list, resend, discard.
    Outbox {
        #[command(subcommand)]
        action: OutboxAction,
    },
    /// Tombstones: IDs declared never to arrive.
    Tombstones {
        #[command(subcommand)]
        action: TombstonesAction,
    },
    /// Open gaps: events the provider sent that have not arrived.
    Gaps {
        #[command(subcommand)]
        action: GapsAction,
    },
    /// Maintenance runs (reconcile, backfill, retention, anomaly).
    Runs {
        #[command(subcommand)]
        action: RunsAction,
    },
    /// Anomaly check results of the latest run.
    Checks {
        #[command(subcommand)]
        action: ChecksAction,
    },
    /// Deliveries refused before anything was stored (bad signature, stale, method, size,
    /// unreadable), the newest 100 of each known source, and what the last day's add up to.
    Refused(hookctl::commands::RefusedArgs),
    /// Operator actions recorded: who replayed, discarded, resent or tombstoned what, and why.
    Actions {
        #[command(subcommand)]
        action: ActionsAction,
    },
    /// The fault drill: inject one fault of each class into the local pipeline and print which
    /// layers noticed it and whether it was repaired without a human. Needs an empty database.
    Drill(drill::DrillArgs),
    /// Run one operator action, the operator Lambda's JSON (replay, list or triage dead letters).
    /// A state change carries its own "actor" and "reason".
    Operator {
        /// e.g. '{"action":"replay","filter":{"event_type":"invoice.paid"}}'
        request: String,
    },
    /// Drain the queue once, as the drain Lambda does.
    Drain,
    /// Run one reconciliation pass, as the reconcile Lambda does.
    Reconcile,
    /// Run one gap detection and backfill pass, as the backfill Lambda does.
    Backfill,
    /// Run one retention pass, as the retention Lambda does.
    Retention,
    /// Run the anomaly checks once, as the anomaly Lambda does.
    Anomaly,
}

#[derive(Args)]
struct ConsoleArgs {
    /// The port on 127.0.0.1 (0: a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Answer requests that change state (replays, discards, tombstones, ...).
    #[arg(long)]
    write: bool,
    /// Who the changes are recorded as (default: the OS user, $USER or $LOGNAME).
    #[arg(long, env = "HOOKCTL_ACTOR")]
    actor: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Sources file applied at start (see docs/configuration.md, "Sources").
    #[arg(long)]
    sources: Option<PathBuf>,
    /// Read signing secrets from this TOML file instead of Secrets Manager.
    #[arg(long)]
    secrets_file: Option<PathBuf>,
    /// Where the outbox delivers what no route covers (default: this runner's own
    /// /outbox-sink, which logs).
    #[arg(long)]
    outbox_target: Option<String>,
    /// Route file applied at start (see docs/destinations.md); routes to AWS go to
    /// EVENTBRIDGE_ENDPOINT, SQS_ENDPOINT and SNS_ENDPOINT (moto locally).
    #[arg(long)]
    routes: Option<PathBuf>,
    /// Create on those endpoints the queues, buses and topics the routes name, each with a tap
    /// queue to read what arrived (a local stand-in such as moto only).
    #[arg(long, requires = "routes")]
    create_destinations: bool,
    /// How often the drain and the outbox look for new work when they found none, in
    /// milliseconds (DRAIN_IDLE_POLL_MS and OUTBOX_IDLE_POLL_MS in AWS).
    #[arg(long, default_value_t = 100)]
    pipeline_interval_ms: u64,
    /// How often backfill, reconcile and retention run, in seconds.
    #[arg(long, default_value_t = 10)]
    maintenance_interval_seconds: u64,
    /// Buffer to a local SQS (SQS_ENDPOINT, e.g. moto): create this queue and its dead-letter
    /// queue `<name>-dlq` if missing, ingest in BUFFER_MODE (default spillover) and file what
    /// the queue holds, as the consumer Lambda does.
    #[arg(long, value_name = "NAME")]
    buffer_queue: Option<String>,
    /// Serve partners that do not sign (`auth = "partner"` sources) at
    /// `https://<this address>/partners/<source id>`, over TLS with client certificates (as the
    /// stack's partner domain does with mutual TLS). Needs the three --partner-* files.
    #[arg(long, value_name = "ADDRESS", requires_all = ["partner_tls_cert", "partner_tls_key", "partner_client_ca"])]
    partner_listen: Option<String>,
    /// The partner listener's own certificate (PEM, its chain first to last).
    #[arg(long, value_name = "PEM")]
    partner_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, value_name = "PEM")]
    partner_tls_key: Option<PathBuf>,
    /// The CA that issues partners' client certificates (PEM): the truststore.
    #[arg(long, value_name = "PEM")]
    partner_client_ca: Option<PathBuf>,
}

#[derive(Subcommand)]
enum SourcesAction {
    /// Insert or update every source in a sources file.
    Apply {
        file: PathBuf,
        /// Let a source with stored events read its event ids another way (its redeliveries of
        /// those events are then stored again as new events); refused without it.
        #[arg(long)]
        change_event_ids: bool,
    },
    /// List the configured sources.
    List,
    /// The SHA-256 fingerprint of a client certificate (PEM), as a partner source pins it in
    /// `[source.partner] client_certificates`. Needs no database.
    Fingerprint {
        #[arg(long)]
        pem: PathBuf,
    },
    /// The client certificates partners' requests came with: fingerprint, subject, expiry,
    /// first and last seen, and whether the source pins it now.
    Certificates,
}

#[derive(Subcommand)]
enum ProvidersAction {
    /// One line per provider: scheme name, title, signature.
    List,
    /// Everything the catalogue says about one provider.
    Show { name: Scheme },
    /// The catalogue as docs/providers.md shows it.
    Markdown,
    /// Validate a draft entry (`<name>.toml`, as under shared/providers/) and run its vectors,
    /// without a rebuild. Exit 0 when it loads and every vector verifies as recorded (at least
    /// one valid and one refused), 1 when a vector disagrees, 2 when it does not load.
    Check { file: PathBuf },
    /// The address ranges providers publish (DATABASE_URL): each list kept, when it was read,
    /// whether it is stale, the sources checking against it, and the addresses seen outside.
    /// `refresh` reads every list a source uses now, as the scheduled pass does when due.
    Ranges {
        #[command(subcommand)]
        action: Option<RangesAction>,
    },
}

#[derive(Subcommand)]
enum RangesAction {
    /// Read every published list an enabled source checks against, now (one recorded pass,
    /// job `address_ranges`). Exit 0 all read, 1 a list could not be read (the one kept stays).
    Refresh {
        /// Read a provider's list here instead of the catalogue's URL (`github=https://...`),
        /// beside ADDRESS_RANGES_URLS; repeatable.
        #[arg(long = "url", value_name = "NAME=URL")]
        urls: Vec<String>,
    },
}

#[derive(Subcommand)]
enum RoutesAction {
    /// Validate a route file without touching the database. Exit 0 valid, 2 not.
    Check { file: PathBuf },
    /// Replace the stored routes with a route file's (validated first; all or nothing).
    Apply { file: PathBuf },
    /// List the stored routes and subscriptions.
    List,
    /// Every subscription: running or paused, its undelivered messages and the oldest's age, its
    /// failed ones (through --function too).
    Subscriptions,
    /// Pause a subscription: its messages wait, nothing is dropped (recorded with --reason).
    Pause {
        #[command(flatten)]
        subscription: commands::SubscriptionName,
        #[command(flatten)]
        decision: commands::Decision,
    },
    /// Resume a paused subscription (paused by an operator, or by a 410 Gone): what waited is
    /// sent.
    Resume {
        #[command(flatten)]
        subscription: commands::SubscriptionName,
        #[command(flatten)]
        decision: commands::Decision,
    },
}

#[derive(Args)]
struct VerifyArgs {
    /// A configured source: its scheme, secrets, tolerance and field map are used.
    #[arg(long, conflicts_with_all = ["scheme", "secret"])]
    source: Option<String>,
    /// The signature scheme, when not checking against a configured source.
    #[arg(long, requires = "secret")]
    scheme: Option<Scheme>,
    /// The signing secret (prefer the environment variable: the command line is visible to others).
    #[arg(long, env = "HOOKCTL_SECRET", hide_env_values = true)]
    secret: Option<String>,
    /// A previous signing secret, also accepted.
    #[arg(long, env = "HOOKCTL_PREVIOUS_SECRET", hide_env_values = true)]
    previous_secret: Option<String>,
    /// File of captured headers, `Name: value` per line (curl -v output works).
    #[arg(long)]
    headers: Option<PathBuf>,
    /// One header, `Name: value` (repeatable).
    #[arg(short = 'H', long = "header")]
    header: Vec<String>,
    /// The raw body exactly as received (`-` for standard input).
    #[arg(long)]
    body: PathBuf,
    /// Timestamp tolerance in seconds (default: the source's, else 300).
    #[arg(long)]
    tolerance: Option<u64>,
    /// Check the timestamp as of this Unix time instead of now (for old captures).
    #[arg(long)]
    at: Option<i64>,
    /// The URL the provider called, for the schemes that sign it (Twilio, Square, HubSpot).
    #[arg(long)]
    url: Option<String>,
    /// The HTTP method the provider used.
    #[arg(long, default_value = "POST")]
    method: String,
    /// The signature layouts accepted, by name (`v3,v1`), as a source's `layouts` names them;
    /// default: the source's, else every layout but the legacy ones.
    #[arg(long, value_delimiter = ',')]
    layouts: Vec<String>,
    #[arg(long)]
    secrets_file: Option<PathBuf>,
}

#[derive(Args)]
struct SignArgs {
    #[arg(long)]
    scheme: Scheme,
    #[arg(long, env = "HOOKCTL_SECRET", hide_env_values = true)]
    secret: String,
    #[arg(long)]
    body: PathBuf,
    /// Message id, signed by Standard Webhooks (default: msg_<timestamp>).
    #[arg(long)]
    id: Option<String>,
    /// Unix time to sign at (default: now).
    #[arg(long)]
    at: Option<i64>,
    /// The URL the delivery goes to, for the schemes that sign it.
    #[arg(long)]
    url: Option<String>,
    /// The HTTP method, for the schemes that sign it.
    #[arg(long, default_value = "POST")]
    method: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let operator_backend = || backend(cli.function.clone(), cli.lambda_endpoint.clone());
    let exit = |code: u8| ExitCode::from(code);
    let result = match cli.command {
        Command::Status => match operator_backend().await {
            Ok(b) => return exit(commands::status(&b, json).await),
            Err(e) => Err(e),
        },
        Command::DeadLetters { action } => match operator_backend().await {
            Ok(b) => return exit(commands::dead_letters(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Buffer { action } => match operator_backend().await {
            Ok(b) => return exit(commands::buffer(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Outbox { action } => match operator_backend().await {
            Ok(b) => return exit(commands::outbox(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Tombstones { action } => match operator_backend().await {
            Ok(b) => return exit(commands::tombstones(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Gaps { action } => match operator_backend().await {
            Ok(b) => return exit(commands::gaps(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Runs { action } => match operator_backend().await {
            Ok(b) => return exit(commands::runs(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Checks { action } => match operator_backend().await {
            Ok(b) => return exit(commands::checks(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Refused(args) => match operator_backend().await {
            Ok(b) => return exit(commands::refused(&b, json, args).await),
            Err(e) => Err(e),
        },
        Command::Actions { action } => match operator_backend().await {
            Ok(b) => return exit(commands::actions(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Drill(args) => match pool().await {
            Ok(pool) => return exit(drill::run(pool, args, json).await),
            Err(e) => Err(e),
        },
        Command::Serve(args) => run_serve(args).await,
        Command::Console(args) => match operator_backend().await {
            Ok(b) => run_console(b, args).await,
            Err(e) => Err(e),
        },
        Command::Migrate => migrate().await,
        Command::Sources { action } => run_sources(action).await,
        Command::Routes {
            action: RoutesAction::Subscriptions,
        } => match operator_backend().await {
            Ok(b) => return exit(commands::list_subscriptions(&b, json).await),
            Err(e) => Err(e),
        },
        Command::Routes {
            action:
                RoutesAction::Pause {
                    subscription,
                    decision,
                },
        } => match operator_backend().await {
            Ok(b) => {
                return exit(
                    commands::pause_or_resume(&b, json, true, subscription, decision).await,
                );
            }
            Err(e) => Err(e),
        },
        Command::Routes {
            action:
                RoutesAction::Resume {
                    subscription,
                    decision,
                },
        } => match operator_backend().await {
            Ok(b) => {
                return exit(
                    commands::pause_or_resume(&b, json, false, subscription, decision).await,
                );
            }
            Err(e) => Err(e),
        },
        Command::Events { action } => match operator_backend().await {
            Ok(b) => return exit(commands::events(&b, json, action).await),
            Err(e) => Err(e),
        },
        Command::Routes { action } => run_routes(action, json).await,
        Command::Verify(args) => return run_verify(args, json).await,
        Command::Sign(args) => run_sign(args, json),
        Command::Providers {
            action: ProvidersAction::Ranges { action },
        } => match run_ranges(action, json).await {
            Ok(code) => return exit(code),
            Err(e) => Err(e),
        },
        Command::Providers { action } => return providers(action, json),
        Command::Operator { request } => match operator_backend().await {
            Ok(b) => run_operator(&b, &request).await,
            Err(e) => Err(e),
        },
        Command::Drain => run_drain().await,
        Command::Reconcile => run_maintenance(Job::Reconcile).await,
        Command::Backfill => run_maintenance(Job::Backfill).await,
        Command::Retention => run_maintenance(Job::Retention).await,
        Command::Anomaly => run_maintenance(Job::Anomaly).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("hookctl: {message}");
            ExitCode::from(2)
        }
    }
}

type CmdResult = Result<(), String>;

/// `hookctl console`: binds 127.0.0.1, prints the URL to open, serves until interrupted.
async fn run_console(backend: Backend, args: ConsoleArgs) -> CmdResult {
    let actor = args
        .actor
        .or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("LOGNAME").ok())
        .filter(|a| !a.trim().is_empty())
        .ok_or("who is this? no --actor (HOOKCTL_ACTOR) and no OS user ($USER, $LOGNAME)")?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let options = hookctl::console::ConsoleOptions {
        write: args.write,
        actor,
    };
    let mode = if options.write {
        "changes allowed"
    } else {
        "read-only"
    };
    let (console, url) = hookctl::console::console(backend, options, local);
    println!("{url}");
    eprintln!("hookctl console: {mode}; open the URL above (its token works once); Ctrl-C stops");
    hookctl::console::serve(listener, console)
        .await
        .map_err(|e| e.to_string())
}

/// The operator function when `--function` is given, else DATABASE_URL.
async fn backend(function: Option<String>, endpoint: Option<String>) -> Result<Backend, String> {
    match function {
        Some(name) => Ok(Backend::function(name, endpoint).await),
        None => {
            let buffer = match Vars::process().buffer_queue().map_err(|e| e.to_string())? {
                Some(queue) => Some(shared::buffer::BufferQueue::connect(&queue).await),
                None => None,
            };
            Ok(Backend::direct_with_buffer(pool().await?, buffer))
        }
    }
}

/// The pool from DATABASE_URL and the DB_* settings, with at least 4 connections.
async fn pool() -> Result<sqlx::PgPool, String> {
    let vars = Vars::process();
    let mut database = vars.database().map_err(|e| e.to_string())?;
    database.pool.max_connections = database.pool.max_connections.max(4);
    let aws = vars.aws_secrets().map_err(|e| e.to_string())?;
    let options = database
        .connect_options(&aws)
        .await
        .map_err(|e| e.to_string())?;
    Ok(store::lazy_pool(options, &database.pool))
}

async fn migrate() -> CmdResult {
    let pool = pool().await?;
    MIGRATOR
        .run(&pool)
        .await
        .map_err(|e| format!("migrations failed: {e}"))?;
    println!("schema is up to date");
    Ok(())
}

async fn apply_sources(
    pool: &sqlx::PgPool,
    file: &Path,
    change_event_ids: bool,
) -> Result<Vec<sources::Source>, String> {
    let list = sources::read_sources_file(file).map_err(|e| e.to_string())?;
    if change_event_ids {
        sources::apply_changing_event_ids(pool, &list).await
    } else {
        sources::apply(pool, &list).await
    }
    .map_err(|e| e.to_string())?;
    Ok(list)
}

async fn run_sources(action: SourcesAction) -> CmdResult {
    if let SourcesAction::Fingerprint { pem } = &action {
        let text = std::fs::read_to_string(pem)
            .map_err(|e| format!("cannot read {}: {e}", pem.display()))?;
        let certificate = shared::partners::ClientCertificate::from_pem(&text, None, None)
            .map_err(|e| format!("{}: {e}", pem.display()))?;
        println!("{}", certificate.fingerprint());
        return Ok(());
    }
    let pool = pool().await?;
    let list = match action {
        SourcesAction::Apply {
            file,
            change_event_ids,
        } => apply_sources(&pool, &file, change_event_ids).await?,
        SourcesAction::List => sources::list(&pool).await.map_err(|e| e.to_string())?,
        SourcesAction::Certificates => {
            let seen = shared::store::partner_certificates::list(&pool)
                .await
                .map_err(|e| e.to_string())?;
            if seen.is_empty() {
                println!("no partner has called with a client certificate");
            }
            for c in seen {
                println!(
                    "{}\t{}\t{}\texpires={}\tfirst_seen={}\tlast_seen={}\t{}",
                    c.source_id,
                    c.sha256,
                    c.subject.as_deref().unwrap_or("-"),
                    c.not_after.map_or("unknown".to_owned(), |t| t.to_rfc3339()),
                    c.first_seen_at.to_rfc3339(),
                    c.last_seen_at.to_rfc3339(),
                    if c.pinned { "pinned" } else { "NOT PINNED" }
                );
            }
            return Ok(());
        }
        SourcesAction::Fingerprint { .. } => return Ok(()),
    };
    for s in list {
        let auth = match &s.partner {
            Some(_) => "partner".to_owned(),
            None => format!("scheme={}", s.scheme),
        };
        println!(
            "{}\ttenant={}\t{auth}\tsecret_ref={}\ttolerance={}s\tenabled={}",
            s.source_id,
            s.tenant_id,
            s.secret_ref,
            s.tolerance.as_secs(),
            s.enabled
        );
    }
    Ok(())
}

fn print_routes(routes: &[shared::outbox::routes::Route]) {
    if routes.is_empty() {
        println!("no routes");
    }
    for r in routes {
        let what = match &r.subscription {
            Some(s) => {
                let types = if s.selection.event_types.is_empty() {
                    "every type".to_owned()
                } else {
                    s.selection.event_types.join(",")
                };
                let filter = s
                    .selection
                    .filter
                    .as_ref()
                    .map(|f| {
                        let values: Vec<String> = f.values.iter().map(|v| v.to_string()).collect();
                        format!(" where {} in [{}]", f.pointer, values.join(", "))
                    })
                    .unwrap_or_default();
                format!("event {} ({types}{filter})", s.name)
            }
            None => r.action.clone(),
        };
        println!(
            "{}\tsource={}\t{}\t→ {}{}",
            r.tenant_id,
            r.source_id.as_deref().unwrap_or("*"),
            what,
            r.destination.describe(),
            r.signing_secret_ref
                .as_deref()
                .map(|s| format!(" (signed with {s})"))
                .unwrap_or_default()
        );
    }
}

/// A route as `--json` prints it: its destination by kind, a subscription's selection.
fn route_json(r: &shared::outbox::routes::Route) -> serde_json::Value {
    use shared::outbox::destinations::Destination;
    let mut destination = match &r.destination {
        Destination::Http { url } => serde_json::json!({"url": url}),
        Destination::EventBridge { bus, event_source } => {
            serde_json::json!({"bus": bus, "event_source": event_source})
        }
        Destination::Sqs { queue_url } => serde_json::json!({"queue_url": queue_url}),
        Destination::Sns { topic_arn } => serde_json::json!({"topic_arn": topic_arn}),
    };
    destination["kind"] = r.destination.kind().as_str().into();
    serde_json::json!({
        "tenant_id": r.tenant_id,
        "source_id": r.source_id,
        "action": r.action,
        "message_action": r.message_action(),
        "destination": destination,
        "signing_secret_ref": r.signing_secret_ref,
        "subscription": r.subscription.as_ref().map(|s| serde_json::json!({
            "name": s.name,
            "event_types": s.selection.event_types,
            "filter": s.selection.filter,
            "rate_limit": s.rate_limit,
        })),
    })
}

fn routes_json(list: &[shared::outbox::routes::Route]) -> serde_json::Value {
    list.iter().map(route_json).collect()
}

async fn run_routes(action: RoutesAction, json: bool) -> CmdResult {
    use shared::outbox::routes;
    match action {
        RoutesAction::Check { file } => {
            let list = routes::read_routes_file(&file).map_err(|e| e.to_string())?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"valid": true, "routes": routes_json(&list)})
                );
            } else {
                print_routes(&list);
                println!("{}: {} route(s), valid", file.display(), list.len());
            }
        }
        RoutesAction::Apply { file } => {
            let list = routes::read_routes_file(&file).map_err(|e| e.to_string())?;
            let pool = pool().await?;
            routes::apply(&pool, &list)
                .await
                .map_err(|e| e.to_string())?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"applied": list.len(), "routes": routes_json(&list)})
                );
            } else {
                print_routes(&list);
                println!("applied {} route(s)", list.len());
            }
        }
        RoutesAction::List => {
            let pool = pool().await?;
            let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
            let list = routes::list(&mut conn).await.map_err(|e| e.to_string())?;
            if json {
                println!("{}", serde_json::json!({"routes": routes_json(&list)}));
            } else {
                print_routes(&list);
            }
        }
        RoutesAction::Subscriptions | RoutesAction::Pause { .. } | RoutesAction::Resume { .. } => {
            return Err("answered through the operator backend".into());
        }
    }
    Ok(())
}

/// The local runner's buffer queues on `SQS_ENDPOINT`, created when missing.
async fn local_buffer_queues(name: &str) -> Result<(String, String), String> {
    let endpoint = std::env::var("SQS_ENDPOINT").map_err(|_| {
        "--buffer-queue needs SQS_ENDPOINT: a local SQS such as moto's server (scripts/run-local starts one)"
            .to_owned()
    })?;
    let endpoint = shared::aws::AwsEndpoint {
        endpoint_url: Some(endpoint),
        region: std::env::var("AWS_REGION").ok(),
    };
    let queue =
        serve::create_buffer_queue(&endpoint, name, 5, serve::LOCAL_VISIBILITY_SECONDS as u32)
            .await?;
    let dead_letters = queue.dead_letter_queue_url().map_err(|e| e.to_string())?;
    Ok((queue.queue_url().to_owned(), dead_letters.to_owned()))
}

async fn run_serve(args: ServeArgs) -> CmdResult {
    shared::telemetry::init();
    let local_queues = match &args.buffer_queue {
        Some(name) => Some(local_buffer_queues(name).await?),
        None => None,
    };
    let vars = Vars(move |name: &str| {
        let local = local_queues.as_ref();
        match name {
            "BUFFER_QUEUE_URL" if local.is_some() => local.map(|q| q.0.clone()),
            "BUFFER_DEAD_LETTER_QUEUE_URL" if local.is_some() => local.map(|q| q.1.clone()),
            "BUFFER_MODE" if local.is_some() => Some(
                std::env::var(name)
                    .ok()
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| "spillover".into()),
            ),
            _ => std::env::var(name).ok().filter(|v| !v.is_empty()),
        }
    });
    let mut settings = vars.ingest().map_err(|e| e.to_string())?;
    settings.database.pool.max_connections = settings.database.pool.max_connections.max(8);
    if let Some(path) = args.secrets_file {
        settings.secrets = SecretsBackend::File(path);
    }
    let ingestor = Ingestor::from_settings(&settings)
        .await
        .map_err(|e| e.to_string())?;
    MIGRATOR
        .run(ingestor.pool())
        .await
        .map_err(|e| format!("migrations failed: {e}"))?;
    if let Some(file) = &args.sources {
        for s in apply_sources(ingestor.pool(), file, false).await? {
            match (&s.partner, &args.partner_listen) {
                (Some(_), Some(partners)) => eprintln!(
                    "source {} (tenant {}, partner) → POST https://{partners}/partners/{} with its client certificate",
                    s.source_id, s.tenant_id, s.source_id
                ),
                (Some(_), None) => eprintln!(
                    "source {} (tenant {}, partner) is not served: a partner is admitted only over TLS with its client certificate; start with --partner-listen ADDRESS --partner-tls-cert PEM --partner-tls-key PEM --partner-client-ca PEM (docs/running-locally.md)",
                    s.source_id, s.tenant_id
                ),
                (None, _) => eprintln!(
                    "source {} (tenant {}, {}) → POST http://{}/webhooks/{}",
                    s.source_id, s.tenant_id, s.scheme, args.listen, s.source_id
                ),
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let registry = Arc::new(EffectRegistry::standard());
    let every = Duration::from_millis(args.pipeline_interval_ms.max(10));
    let drainer = Drainer::new(
        ingestor.pool().clone(),
        registry.clone(),
        shared::drain::DrainSettings {
            idle_poll: every,
            ..vars.drain().map_err(|e| e.to_string())?
        },
    );
    let target = args
        .outbox_target
        .unwrap_or_else(|| format!("http://{}/outbox-sink", args.listen));
    let endpoints = vars.outbox_endpoints();
    if let Some(file) = &args.routes {
        let routes = shared::outbox::routes::read_routes_file(file).map_err(|e| e.to_string())?;
        if args.create_destinations {
            for line in serve::create_local_destinations(&endpoints, &routes).await? {
                eprintln!("outbox destination: {line}");
            }
        }
        shared::outbox::routes::apply(ingestor.pool(), &routes)
            .await
            .map_err(|e| e.to_string())?;
        for r in &routes {
            eprintln!(
                "route: {} of tenant {}{} → {}",
                r.message_action(),
                r.tenant_id,
                r.source_id
                    .as_deref()
                    .map(|s| format!(", source {s}"))
                    .unwrap_or_default(),
                r.destination.describe()
            );
        }
    }
    let sender = OutboxSender::new(
        ingestor.pool().clone(),
        OutboxSettings {
            endpoints,
            idle_poll: every,
            ..OutboxSettings::new(&target)
        },
    )
    .map_err(|e| e.to_string())?
    .with_secrets(Arc::new(settings.secrets.open().await));
    let drainer = Arc::new(drainer);
    let _pipeline = serve::spawn_pipeline(drainer.clone(), Some(Arc::new(sender)), every);
    let secrets = settings.secrets.open().await;
    let backfiller = shared::backfill::Backfiller::new(
        ingestor.pool().clone(),
        Arc::new(secrets),
        vars.backfill().map_err(|e| e.to_string())?,
    );
    let buffer = match &settings.buffer.queue {
        Some(queue) => Some(shared::buffer::BufferQueue::connect(queue).await),
        None => None,
    };
    let backfiller = match &buffer {
        Some(queue) => backfiller.with_buffer(queue.clone()),
        None => backfiller,
    };
    let maintenance_every = Duration::from_secs(args.maintenance_interval_seconds.max(1));
    let _maintenance = serve::spawn_maintenance(
        ingestor.pool().clone(),
        drainer,
        Arc::new(backfiller),
        serve::MaintenanceSettings {
            reconcile: vars.reconcile().map_err(|e| e.to_string())?,
            retention: vars.retention().map_err(|e| e.to_string())?,
            anomaly: vars.anomaly().map_err(|e| e.to_string())?,
        },
        buffer,
        maintenance_every,
    );
    let _consumer = match &settings.buffer.queue {
        Some(queue) => {
            eprintln!(
                "buffer: {} mode, SQS queue {} (dead letters: {}); the consumer files what it holds",
                settings.buffer.mode.as_str(),
                queue.queue_url,
                queue.dead_letter_queue_url.as_deref().unwrap_or("none"),
            );
            Some(serve::spawn_buffer_consumer(
                ingestor.pool().clone(),
                shared::buffer::BufferQueue::connect(queue).await,
                Duration::from_millis(200),
            ))
        }
        None => {
            eprintln!(
                "buffer: database mode, no second buffer (a delivery the database cannot take is answered 503)"
            );
            None
        }
    };
    eprintln!(
        "ingest listening on http://{}; drain and outbox (→ {target}) every {} ms; backfill, reconcile, retention every {} s",
        args.listen,
        every.as_millis(),
        maintenance_every.as_secs()
    );
    let runner = serve::Runner {
        ingestor: Arc::new(ingestor),
        registry,
        buffer: match &settings.buffer.queue {
            Some(queue) => Some(shared::buffer::BufferQueue::connect(queue).await),
            None => None,
        },
    };
    let partners = match (
        &args.partner_listen,
        &args.partner_tls_cert,
        &args.partner_tls_key,
        &args.partner_client_ca,
    ) {
        (Some(address), Some(certificate), Some(key), Some(client_ca)) => {
            let acceptor =
                hookctl::partner_tls::acceptor(&hookctl::partner_tls::PartnerTlsFiles {
                    certificate,
                    key,
                    client_ca,
                })?;
            let tcp = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| format!("cannot listen on {address}: {e}"))?;
            eprintln!(
                "partners listening on https://{address}/partners/<source id> (TLS, client certificates from {})",
                client_ca.display()
            );
            let router = hookctl::partner_tls::router(runner.clone(), settings.max_body_bytes);
            Some(tokio::spawn(hookctl::partner_tls::serve(
                hookctl::partner_tls::PartnerListener::new(tcp, acceptor),
                router,
            )))
        }
        _ => None,
    };
    let router = serve::router(runner, settings.max_body_bytes);
    let served = tokio::select! {
        served = serve::serve(listener, router) => served.map_err(|e| e.to_string()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    };
    if let Some(partners) = partners {
        partners.abort();
    }
    served
}

fn read_body(path: &Path) -> Result<Vec<u8>, String> {
    if path == Path::new("-") {
        let mut body = Vec::new();
        std::io::stdin()
            .read_to_end(&mut body)
            .map_err(|e| format!("reading standard input: {e}"))?;
        Ok(body)
    } else {
        std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

async fn run_verify(args: VerifyArgs, json: bool) -> ExitCode {
    match verify_command(args).await {
        Ok(report) => {
            if json {
                println!(
                    "{}",
                    serde_json::json!({"valid": report.valid, "lines": report.lines})
                );
            } else {
                for line in &report.lines {
                    println!("{line}");
                }
            }
            if report.valid {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(message) => {
            eprintln!("hookctl verify: {message}");
            ExitCode::from(2)
        }
    }
}

async fn verify_command(args: VerifyArgs) -> Result<verify::Report, String> {
    let body = read_body(&args.body)?;
    let mut headers = match &args.headers {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            captured::parse_headers(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => http::HeaderMap::new(),
    };
    for line in &args.header {
        captured::append(&mut headers, line).map_err(|e| e.to_string())?;
    }
    let mut layouts = (!args.layouts.is_empty()).then(|| args.layouts.clone());
    let (scheme, secrets, tolerance, fields, source_line, declared) = if let Some(id) = &args.source
    {
        let id = SourceId::parse(id).map_err(|e| e.to_string())?;
        let pool = pool().await?;
        let source = sources::find(&pool, &id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no source {id}"))?;
        let store = match args.secrets_file {
            Some(path) => SecretStore::File(path),
            None => Vars::process()
                .secret_store()
                .await
                .map_err(|e| e.to_string())?,
        };
        let secrets = store
            .secrets(&source.secret_ref)
            .await
            .map_err(|e| e.to_string())?;
        let line = format!(
            "source {} (tenant {}, secret {}{})",
            source.source_id,
            source.tenant_id,
            source.secret_ref,
            if source.enabled {
                ""
            } else {
                ", DISABLED: ingest answers 404"
            }
        );
        if layouts.is_none() {
            layouts = source.layouts.clone();
        }
        (
            source.scheme,
            secrets,
            source.tolerance,
            Some(source.fields.clone()),
            Some(line),
            source.signature,
        )
    } else {
        let scheme = args
            .scheme
            .ok_or("give --source, or --scheme with --secret")?;
        let secret = args
            .secret
            .ok_or("--secret (or HOOKCTL_SECRET) is required with --scheme")?;
        (
            scheme,
            Arc::new(SecretSet::new(secret, args.previous_secret)),
            sources::default_tolerance(scheme),
            None,
            None,
            None,
        )
    };
    let mut report = verify::check(&verify::Check {
        scheme,
        secrets: &secrets,
        headers: &headers,
        body: &body,
        tolerance: args.tolerance.map(Duration::from_secs).unwrap_or(tolerance),
        now: args.at.unwrap_or_else(unix_now),
        fields: fields.as_ref(),
        url: args.url.as_deref(),
        method: &args.method,
        declared,
        layouts: layouts.as_deref(),
    });
    if let Some(line) = source_line {
        report.lines.insert(0, line);
    }
    Ok(report)
}

async fn run_operator(backend: &Backend, request: &str) -> CmdResult {
    let json: serde_json::Value =
        serde_json::from_str(request).map_err(|e| format!("request is not JSON: {e}"))?;
    let request = shared::operator::parse(json).map_err(|e| e.to_string())?;
    let response = backend
        .call_json(&request)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string_pretty(&response).unwrap_or_default()
    );
    Ok(())
}

async fn run_drain() -> CmdResult {
    let vars = Vars::process();
    let drainer = Drainer::new(
        pool().await?,
        Arc::new(EffectRegistry::standard()),
        vars.drain().map_err(|e| e.to_string())?,
    );
    let progress = commands::spinner("draining");
    let outcome = drainer
        .drain_until(std::time::Instant::now() + Duration::from_secs(3600))
        .await
        .map_err(|e| e.to_string());
    progress.finish_and_clear();
    let outcome = outcome?;
    println!("{}", serde_json::to_string(&outcome).unwrap_or_default());
    Ok(())
}

enum Job {
    Reconcile,
    Backfill,
    Retention,
    Anomaly,
}

async fn run_maintenance(job: Job) -> CmdResult {
    let vars = Vars::process();
    let pool = pool().await?;
    let progress = commands::spinner(match job {
        Job::Reconcile => "reconcile pass",
        Job::Backfill => "backfill pass",
        Job::Retention => "retention pass",
        Job::Anomaly => "anomaly checks",
    });
    let report = pass(job, &vars, pool).await;
    progress.finish_and_clear();
    println!("{}", report?);
    Ok(())
}

/// One pass, as its Lambda runs it; its outcome as JSON.
async fn pass<F: Fn(&str) -> Option<String>>(
    job: Job,
    vars: &Vars<F>,
    pool: sqlx::PgPool,
) -> Result<serde_json::Value, String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let report = match job {
        Job::Reconcile => {
            let drainer = Drainer::new(
                pool.clone(),
                Arc::new(EffectRegistry::standard()),
                vars.drain().map_err(|e| err(&e))?,
            );
            let settings = vars.reconcile().map_err(|e| err(&e))?;
            serde_json::to_value(
                shared::reconcile::run_once(&pool, &drainer, &settings, "operator")
                    .await
                    .map_err(|e| err(&e))?,
            )
        }
        Job::Backfill => {
            let secrets = vars.secret_store().await.map_err(|e| err(&e))?;
            let backfiller = shared::backfill::Backfiller::new(
                pool,
                Arc::new(secrets),
                vars.backfill().map_err(|e| err(&e))?,
            );
            serde_json::to_value(backfiller.run_once("operator").await.map_err(|e| err(&e))?)
        }
        Job::Anomaly => {
            let settings = vars.anomaly().map_err(|e| err(&e))?;
            let buffer = match vars.buffer_queue().map_err(|e| err(&e))? {
                Some(queue) => Some(shared::buffer::BufferQueue::connect(&queue).await),
                None => None,
            };
            serde_json::to_value(
                shared::anomaly::run_once_with_buffer(
                    &pool,
                    &settings,
                    "operator",
                    buffer.as_ref(),
                )
                .await
                .map_err(|e| err(&e))?,
            )
        }
        Job::Retention => {
            let settings = vars.retention().map_err(|e| err(&e))?;
            serde_json::to_value(
                shared::retention::run_once(&pool, &settings, "operator")
                    .await
                    .map_err(|e| err(&e))?,
            )
        }
    };
    Ok(report.unwrap_or_default())
}
/// `hookctl providers check FILE`: the draft entry loaded as the catalogue loads its files, then
/// its vectors verified as the catalogue test verifies them.
fn check_provider(file: &std::path::Path) -> ExitCode {
    use shared::catalogue;
    let name = file
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
        .to_owned();
    let loaded = std::fs::read_to_string(file)
        .map_err(|e| format!("{}: {e}", file.display()))
        .and_then(|text| {
            catalogue::load(&name, &text).map_err(|e| format!("{}: {e}", file.display()))
        });
    let provider = match loaded {
        Ok(provider) => provider,
        Err(message) => {
            eprintln!("hookctl: {message}");
            return ExitCode::from(2);
        }
    };
    // One process, one draft: verification borrows layouts for 'static, as it does the
    // catalogue's.
    let provider: &'static catalogue::Provider = Box::leak(Box::new(provider));
    println!(
        "{name}: loads ({} layout(s), {} vector(s))",
        provider.signatures.len(),
        provider.vectors.len()
    );
    let checks = shared::signature::vectors::check_vectors(provider);
    for check in &checks {
        let verdict = match (&check.verified, check.recorded_valid) {
            (Ok(()), true) => "valid, as recorded".to_owned(),
            (Err(why), false) => format!("refused, as recorded ({why})"),
            (Ok(()), false) => "MISMATCH: verified, but recorded as refused".to_owned(),
            (Err(why), true) => format!("MISMATCH: refused ({why}), but recorded as valid"),
        };
        println!("vector {} ({}): {verdict}", check.index, check.source);
    }
    let handshakes = shared::protocol::check_handshakes(provider);
    for check in &handshakes {
        let verdict = match &check.mismatch {
            None => "answered as recorded".to_owned(),
            Some(why) => format!("MISMATCH: {why}"),
        };
        println!(
            "handshake vector {} ({}): {verdict}",
            check.index, check.source
        );
    }
    let agree = checks
        .iter()
        .all(shared::signature::vectors::VectorCheck::agrees)
        && handshakes.iter().all(|c| c.mismatch.is_none());
    let both = checks.iter().any(|c| c.recorded_valid) && checks.iter().any(|c| !c.recorded_valid);
    if !both {
        println!("an entry needs at least one valid vector and one refused");
    }
    if agree && both {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn providers(action: ProvidersAction, json: bool) -> ExitCode {
    use shared::catalogue;
    let text: String = match action {
        ProvidersAction::List if json => {
            let list: Vec<serde_json::Value> = catalogue::providers()
                .map(|(scheme, p)| {
                    let signatures: Vec<String> =
                        p.signatures.iter().map(catalogue::describe).collect();
                    serde_json::json!({
                        "scheme": scheme.as_str(),
                        "title": p.title,
                        "signatures": signatures,
                    })
                })
                .collect();
            format!("{}\n", serde_json::Value::Array(list))
        }
        ProvidersAction::List => catalogue::providers()
            .map(|(scheme, p)| {
                let signature: Vec<String> = p.signatures.iter().map(catalogue::describe).collect();
                format!("{scheme:<22} {:<36} {}\n", p.title, signature.join("; or "))
            })
            .collect(),
        ProvidersAction::Show { name } => catalogue::show(name),
        ProvidersAction::Markdown => catalogue::markdown(),
        ProvidersAction::Check { file } => return check_provider(&file),
        // Reads the database: dispatched before this.
        ProvidersAction::Ranges { .. } => return ExitCode::from(2),
    };
    print!("{text}");
    ExitCode::SUCCESS
}

/// `hookctl providers ranges [refresh]`: 0 every list read (or listed), 1 one could not be
/// read, 2 could not tell.
async fn run_ranges(action: Option<RangesAction>, json: bool) -> Result<u8, String> {
    use shared::address_ranges::{self, RangeRefresher, RangesRun, RangesSettings};
    let pool = pool().await?;
    let Some(RangesAction::Refresh { urls }) = action else {
        let report = address_ranges::report(&pool)
            .await
            .map_err(|e| e.to_string())?;
        let outside = store::deliveries_outside_ranges::list(&pool, 20)
            .await
            .map_err(|e| e.to_string())?;
        if json {
            let value = serde_json::json!({ "providers": report, "outside": outside });
            println!(
                "{}",
                serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?
            );
            return Ok(0);
        }
        for p in &report {
            println!(
                "{}\t{}\t{} range(s)\tread {}\tfrom {}{}",
                p.provider,
                p.state,
                p.ranges,
                p.fetched_at.map_or_else(
                    || "never".to_owned(),
                    |at| at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
                ),
                p.published,
                match &p.last_error {
                    Some(error) if p.failures > 0 =>
                        format!("\t{} failed tries, last: {error}", p.failures),
                    _ => String::new(),
                }
            );
            println!(
                "\tchecked by: {}",
                if p.sources.is_empty() {
                    "no source".to_owned()
                } else {
                    p.sources.join(", ")
                }
            );
        }
        if !outside.is_empty() {
            println!("addresses outside their provider's ranges, most recently seen first:");
        }
        for o in &outside {
            println!(
                "\t{}\t{}\t{}\tadmitted {}, refused {}\tlast {}",
                o.source_id,
                o.provider,
                o.source_address,
                o.admitted,
                o.refused,
                o.last_seen_at.format("%Y-%m-%d %H:%M:%S UTC")
            );
        }
        return Ok(0);
    };
    let mut settings = Vars::process()
        .address_ranges()
        .map_err(|e| e.to_string())?;
    settings
        .urls
        .extend(RangesSettings::parse_urls(&urls.join(","))?);
    // On demand: every list a source uses is read now, however recent.
    settings.refresh_after = Duration::ZERO;
    let progress = commands::spinner("address ranges pass");
    let run = RangeRefresher::new(pool, settings)
        .run_once("operator")
        .await;
    progress.finish_and_clear();
    let run = run.map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::to_string_pretty(&run).map_err(|e| e.to_string())?
    );
    Ok(match run {
        RangesRun::Completed { outcome, .. } if !outcome.failed.is_empty() => 1,
        _ => 0,
    })
}

/// Prints the headers, `Name: value` a line, or with `--json` one object of them by name.
fn run_sign(args: SignArgs, json: bool) -> CmdResult {
    let body = read_body(&args.body)?;
    let at = args.at.unwrap_or_else(unix_now);
    let id = args.id.unwrap_or_else(|| format!("msg_{at}"));
    let headers = shared::signature::sign_request(
        args.scheme,
        &SigningSecret::new(args.secret),
        &shared::signature::Signing {
            message_id: &id,
            timestamp: at,
            body: &body,
            method: &args.method,
            url: args.url.as_deref(),
        },
    )
    .map_err(|e| e.to_string())?;
    if json {
        let object: serde_json::Map<String, serde_json::Value> = headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    value.to_str().unwrap_or_default().into(),
                )
            })
            .collect();
        println!("{}", serde_json::Value::Object(object));
    } else {
        for (name, value) in headers {
            println!("{name}: {}", value.to_str().unwrap_or_default());
        }
    }
    Ok(())
}
