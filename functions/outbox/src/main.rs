use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::outbox::OutboxSender;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.outbox()?;
    let margin = vars.deadline_margin()?;
    let database = shared::database::Database::from_vars(&vars).await?;
    // Routes that sign their HTTP deliveries name their secret (`signing_secret_ref`).
    let sender = OutboxSender::new(database.pool().clone(), settings)?
        .with_secrets(std::sync::Arc::new(vars.secret_store().await?));
    let metrics = shared::metrics::install_emf()?;
    let (database, sender) = (&database, &sender);
    run(service_fn(move |event| async move {
        let result = outbox::handler(event, sender, margin).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        let _ = metrics.flush(std::io::stdout());
        result
    }))
    .await
}
