use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.retention()?;
    let pool = vars.pool().await?;
    let (pool, settings) = (&pool, &settings);
    run(service_fn(move |event| {
        retention::handler(event, pool, settings)
    }))
    .await
}
