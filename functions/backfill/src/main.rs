use std::sync::Arc;

use lambda_runtime::{run, service_fn};
use shared::backfill::Backfiller;
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let database = shared::database::Database::from_vars(&vars).await?;
    let backfiller = Backfiller::new(
        database.pool().clone(),
        Arc::new(vars.secret_store().await?),
        vars.backfill()?,
    );
    // A buffered event is not missing: gaps wait while the buffer holds deliveries.
    let backfiller = match vars.buffer_queue()? {
        Some(queue) => backfiller.with_buffer(shared::buffer::BufferQueue::connect(&queue).await),
        None => backfiller,
    };
    let ranges = shared::address_ranges::RangeRefresher::new(
        database.pool().clone(),
        vars.address_ranges()?,
    );
    let (database, backfiller, ranges) = (&database, &backfiller, &ranges);
    run(service_fn(move |event| async move {
        let result = backfill::handler(event, backfiller, ranges).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        result
    }))
    .await
}
