use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let pool = Vars::process().pool().await?;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?;
    let (pool, http) = (&pool, &http);
    run(service_fn(move |event| migrate::handler(event, pool, http))).await
}
