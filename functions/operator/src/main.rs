use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::effects::EffectRegistry;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let database = shared::database::Database::from_vars(&vars).await?;
    let registry = EffectRegistry::standard();
    let buffer = match vars.buffer_queue()? {
        Some(queue) => Some(shared::buffer::BufferQueue::connect(&queue).await),
        None => None,
    };
    let (database, registry, buffer) = (&database, &registry, buffer.as_ref());
    run(service_fn(move |event| async move {
        let result = operator::handler(event, database.pool(), registry, buffer).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        result
    }))
    .await
}
