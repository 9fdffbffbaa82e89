use lambda_runtime::{run, service_fn};
use shared::config::Vars;

/// Nothing fallible at init: a custom resource whose init fails never answers CloudFormation.
/// Settings, the secret and the connection are read per invocation, inside its deadline.
#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    shared::telemetry::init();
    let vars = Vars::process();
    let vars = &vars;
    run(service_fn(move |event| migrate::handler(event, vars))).await
}
