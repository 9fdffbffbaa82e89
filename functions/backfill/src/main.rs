use std::sync::Arc;

use lambda_runtime::{run, service_fn};
use shared::backfill::Backfiller;
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let backfiller = Backfiller::new(
        vars.pool().await?,
        Arc::new(vars.secret_store().await?),
        vars.backfill()?,
    );
    let backfiller = &backfiller;
    run(service_fn(move |event| {
        backfill::handler(event, backfiller)
    }))
    .await
}
