use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let database = shared::database::Database::from_vars(&vars).await?;
    let metrics = shared::metrics::install_emf()?;
    let database = &database;
    run(service_fn(move |event| async move {
        let result = buffer::handler(event, database.pool()).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        let _ = metrics.flush(std::io::stdout());
        result
    }))
    .await
}
