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
    let pool = vars.pool().await?;
    let drainer = Drainer::new(
        pool.clone(),
        Arc::new(EffectRegistry::standard()),
        vars.drain()?,
    );
    let metrics = shared::metrics::install_emf()?;
    let (pool, drainer, settings) = (&pool, &drainer, &settings);
    run(service_fn(move |event| async move {
        let outcome = reconcile::handler(event, pool, drainer, settings).await;
        let _ = metrics.flush(std::io::stdout());
        outcome
    }))
    .await
}
