use std::sync::Arc;

use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.drain()?;
    let margin = vars.deadline_margin()?;
    let database = shared::database::Database::from_vars(&vars).await?;
    let drainer = Drainer::new(
        database.pool().clone(),
        Arc::new(EffectRegistry::standard()),
        settings,
    );
    let metrics = shared::metrics::install_emf()?;
    let (database, drainer) = (&database, &drainer);
    run(service_fn(move |event| async move {
        let result = drain::handler(event, drainer, margin).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        let _ = metrics.flush(std::io::stdout());
        result
    }))
    .await
}
