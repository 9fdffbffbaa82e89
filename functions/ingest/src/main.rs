use lambda_http::{run, service_fn};
use shared::config::Vars;
use shared::ingest::Ingestor;

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    shared::telemetry::init();
    let settings = Vars::process().ingest()?;
    let ingestor = Ingestor::from_settings(&settings).await?;
    let metrics = shared::metrics::install_emf()?;
    let ingestor = &ingestor;
    run(service_fn(move |request| async move {
        let response = ingest::handler(request, ingestor).await;
        // One EMF document per invocation, on the function's log stream.
        let _ = metrics.flush(std::io::stdout());
        response
    }))
    .await
}
