use lambda_runtime::{run, service_fn};
use shared::config::Vars;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.retention()?;
    let margin = vars.deadline_margin()?;
    let database = shared::database::Database::from_vars(&vars).await?;
    let (database, settings) = (&database, &settings);
    run(service_fn(move |event| async move {
        let result = retention::handler(event, database.pool(), settings, margin).await;
        database
            .after_failure(result.as_ref().err().map(|d| d.error_type.as_str()))
            .await;
        result
    }))
    .await
}
