use lambda_runtime::{run, service_fn};
use shared::config::Vars;
use shared::outbox::OutboxSender;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let settings = vars.outbox()?;
    let margin = vars.deadline_margin()?;
    let sender = OutboxSender::new(vars.pool().await?, settings)?;
    let sender = &sender;
    run(service_fn(move |event| {
        outbox::handler(event, sender, margin)
    }))
    .await
}
