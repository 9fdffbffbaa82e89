use std::sync::Arc;

use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::drain::Drainer;
use shared::effects::EffectRegistry;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.reconcile()?;
    let database = shared::database::Database::from_vars(&vars).await?;
    let pool = database.pool().clone();
    let drainer = Drainer::new(
        pool.clone(),
        Arc::new(EffectRegistry::standard()),
        vars.drain()?,
    );
    let metrics = shared::metrics::install_emf()?;
    let (database, pool, drainer, settings) = (&database, &pool, &drainer, &settings);
    run(service_fn(move |event| async move {
        let result = reconcile::handler(event, pool, drainer, settings).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        let _ = metrics.flush(std::io::stdout());
        result
    }))
    .await
}
