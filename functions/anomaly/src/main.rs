use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.anomaly()?;
    let pool = vars.pool().await?;
    let metrics = shared::metrics::install_emf()?;
    let (pool, settings) = (&pool, &settings);
    run(service_fn(move |event| async move {
        let report = anomaly::handler(event, pool, settings).await;
        let _ = metrics.flush(std::io::stdout());
        report
    }))
    .await
}
