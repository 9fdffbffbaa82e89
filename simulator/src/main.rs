//! `provider-simulator`: serve the provider API and deliver its events to a receiver.
//!
//! ```text
//! provider-simulator --deliver-to http://127.0.0.1:8080/webhooks/sim-provider \
//!     --events 1000 --drop 0.05 --duplicate 0.1 --reorder 10 --listen 127.0.0.1:8090
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use simulator::{DeliveryPlan, Provider, ProviderConfig};

#[derive(Parser)]
#[command(name = "provider-simulator", version)]
struct Args {
    /// The receiver's webhook URL.
    #[arg(long)]
    deliver_to: String,
    #[arg(long, default_value_t = 1000)]
    events: u64,
    /// Sequence numbers that never existed (comma-separated).
    #[arg(long, value_delimiter = ',')]
    never_existed: Vec<u64>,
    #[arg(long, default_value_t = 100)]
    entities: u64,
    /// Event types the events cycle through (comma-separated; default: all item.updated).
    #[arg(long, value_delimiter = ',')]
    event_types: Vec<String>,
    #[arg(long, default_value_t = 0.0)]
    drop: f64,
    #[arg(long, default_value_t = 0.0)]
    duplicate: f64,
    #[arg(long, default_value_t = 1)]
    reorder: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Stripe-scheme signing secret of the receiving source.
    #[arg(
        long,
        env = "SIMULATOR_SIGNING_SECRET",
        default_value = "whsec_local_simulator"
    )]
    signing_secret: String,
    /// API key the list and fetch endpoints require as a bearer token.
    #[arg(long, env = "SIMULATOR_API_KEY", default_value = "sk_local_simulator")]
    api_key: String,
    /// Where the provider API listens.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let now = shared::ingest::unix_now();
    let provider = Provider::new(ProviderConfig {
        events: args.events,
        never_existed: args.never_existed.clone(),
        entities: args.entities,
        first_created: now - args.events as i64 - 1,
        signing_secret: args.signing_secret.clone(),
        api_key: args.api_key.clone(),
        event_types: args.event_types.clone(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .expect("bind the provider API");
    let api = Arc::clone(&provider).router();
    tokio::spawn(async move { axum::serve(listener, api).await });
    eprintln!(
        "provider API on http://{} (bearer {})",
        args.listen, args.api_key
    );

    let plan = DeliveryPlan {
        duplicate_rate: args.duplicate,
        drop_rate: args.drop,
        reorder_window: args.reorder,
        seed: args.seed,
        signed_at: now,
    };
    let (deliveries, report) = provider.deliveries(plan);
    let statuses = simulator::send(&args.deliver_to, deliveries, args.concurrency).await;
    eprintln!(
        "{} events: sent {} ({} duplicates, {} reordered), dropped {}; responses by status: {statuses:?}",
        report.events,
        report.sent,
        report.duplicates,
        report.reordered,
        report.dropped.len()
    );
    eprintln!(
        "serving the provider API until Ctrl-C (backfill fetches the dropped events from it)"
    );
    let _ = tokio::signal::ctrl_c().await;
}
