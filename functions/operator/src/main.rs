use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::effects::EffectRegistry;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let database = shared::database::Database::from_vars(&Vars::process()).await?;
    let registry = EffectRegistry::standard();
    let (database, registry) = (&database, &registry);
    run(service_fn(move |event| async move {
        let result = operator::handler(event, database.pool(), registry).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        result
    }))
    .await
}
