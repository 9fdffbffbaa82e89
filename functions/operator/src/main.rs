use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::effects::EffectRegistry;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let pool = Vars::process().pool().await?;
    let registry = EffectRegistry::standard();
    let (pool, registry) = (&pool, &registry);
    run(service_fn(move |event| {
        operator::handler(event, pool, registry)
    }))
    .await
}
