use lambda_http::{run, service_fn};
use shared::config::Vars;
use shared::ingest::Ingestor;

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    shared::telemetry::init();
    let settings = Vars::process().ingest()?;
    let ingestor = Ingestor::from_settings(&settings).await?;
    let ingestor = &ingestor;
    run(service_fn(move |request| {
        ingest::handler(request, ingestor)
    }))
    .await
}
