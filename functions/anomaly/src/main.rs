use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.anomaly()?;
    let database = shared::database::Database::from_vars(&vars).await?;
    let metrics = shared::metrics::install_emf()?;
    // A buffered event is not missing: no source is silent while the buffer holds deliveries.
    let buffer = match vars.buffer_queue()? {
        Some(queue) => Some(shared::buffer::BufferQueue::connect(&queue).await),
        None => None,
    };
    let (database, settings, buffer) = (&database, &settings, buffer.as_ref());
    run(service_fn(move |event| async move {
        let result = anomaly::handler(event, database.pool(), settings, buffer).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        let _ = metrics.flush(std::io::stdout());
        result
    }))
    .await
}
