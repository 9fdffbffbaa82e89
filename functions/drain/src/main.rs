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
    let drainer = Drainer::new(
        vars.pool().await?,
        Arc::new(EffectRegistry::standard()),
        settings,
    );
    let metrics = shared::metrics::install_emf()?;
    let drainer = &drainer;
    run(service_fn(move |event| async move {
        let summary = drain::handler(event, drainer, margin).await;
        let _ = metrics.flush(std::io::stdout());
        summary
    }))
    .await
}
