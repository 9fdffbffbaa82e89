//! Where an operator command is answered: directly against `DATABASE_URL`, or by invoking the
//! deployed operator function (`--function <name or ARN>`), whose database sits in private
//! subnets. Both take the operator's JSON request and answer with the same JSON, computed by
//! the same `shared::operator::handle`; the commands render it and never know which way it came.

use aws_sdk_lambda::primitives::Blob;
use serde::de::DeserializeOwned;
use shared::effects::EffectRegistry;
use shared::operator::{self, OperatorError, OperatorRequest};
use shared::store::PgPool;

pub enum Backend {
    Direct {
        pool: PgPool,
        registry: EffectRegistry,
        /// The buffer's queues, when `BUFFER_QUEUE_URL` is set.
        buffer: Option<shared::buffer::BufferQueue>,
    },
    Function {
        client: aws_sdk_lambda::Client,
        name: String,
    },
}

/// Why a command got no answer. Either way the operator cannot tell: exit 2.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The request was refused as invalid (a bad filter, an unknown id).
    #[error("{0}")]
    BadRequest(String),
    /// The database or the function could not be reached, or failed.
    #[error("{0}")]
    Unavailable(String),
    /// The answer did not have the shape asked for (a function of another version).
    #[error("unexpected answer: {0}")]
    Unexpected(String),
}

impl Backend {
    /// The operator function, through the Lambda Invoke API. `endpoint_url` overrides the
    /// endpoint (a VPC endpoint, or a test's stand-in); credentials and region come from the
    /// environment as for the AWS CLI.
    pub async fn function(name: String, endpoint_url: Option<String>) -> Self {
        let config = shared::aws::sdk_config(&shared::aws::AwsEndpoint {
            endpoint_url,
            region: None,
        })
        .await;
        Backend::Function {
            client: aws_sdk_lambda::Client::new(&config),
            name,
        }
    }

    pub fn direct(pool: PgPool) -> Self {
        Backend::Direct {
            pool,
            registry: EffectRegistry::standard(),
            buffer: None,
        }
    }

    /// Direct, with the buffer's queues (`hookctl status` and `hookctl buffer` read them).
    pub fn direct_with_buffer(pool: PgPool, buffer: Option<shared::buffer::BufferQueue>) -> Self {
        Backend::Direct {
            pool,
            registry: EffectRegistry::standard(),
            buffer,
        }
    }

    /// Where answers come from, for messages.
    pub fn describe(&self) -> String {
        match self {
            Backend::Direct { .. } => "DATABASE_URL".into(),
            Backend::Function { name, .. } => format!("function {name}"),
        }
    }

    /// Sends one request and reads the answer as `T`.
    pub async fn call<T: DeserializeOwned>(
        &self,
        request: &OperatorRequest,
    ) -> Result<T, CallError> {
        let answer = self.call_json(request).await?;
        serde_json::from_value(answer).map_err(|e| CallError::Unexpected(e.to_string()))
    }

    pub async fn call_json(
        &self,
        request: &OperatorRequest,
    ) -> Result<serde_json::Value, CallError> {
        match self {
            Backend::Direct {
                pool,
                registry,
                buffer,
            } => {
                let invocation = operator::Invocation::via(operator::Via::Hookctl);
                match Box::pin(operator::handle_invoked(
                    pool,
                    registry,
                    buffer.as_ref(),
                    request.clone(),
                    &invocation,
                ))
                .await
                {
                    Ok(response) => serde_json::to_value(response)
                        .map_err(|e| CallError::Unexpected(e.to_string())),
                    Err(OperatorError::BadRequest(message)) => Err(CallError::BadRequest(message)),
                    Err(e) => Err(CallError::Unavailable(e.to_string())),
                }
            }
            Backend::Function { client, name } => {
                let payload = serde_json::to_vec(request)
                    .map_err(|e| CallError::Unexpected(e.to_string()))?;
                let output = client
                    .invoke()
                    .function_name(name)
                    .payload(Blob::new(payload))
                    .send()
                    .await
                    .map_err(|e| {
                        CallError::Unavailable(format!(
                            "invoking {name}: {}",
                            aws_sdk_lambda::error::DisplayErrorContext(&e)
                        ))
                    })?;
                let body = output.payload().map(|b| b.as_ref()).unwrap_or_default();
                if let Some(kind) = output.function_error() {
                    return Err(function_error(kind, body));
                }
                serde_json::from_slice(body).map_err(|e| CallError::Unexpected(e.to_string()))
            }
        }
    }
}

/// A function error's payload is `{"errorType": …, "errorMessage": …}`; the operator function
/// says `BadRequest` for a request it refused.
fn function_error(kind: &str, body: &[u8]) -> CallError {
    let parsed: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let error_type = parsed["errorType"].as_str().unwrap_or(kind);
    let message = parsed["errorMessage"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    if error_type == "BadRequest" {
        CallError::BadRequest(message)
    } else {
        CallError::Unavailable(format!("the function failed ({error_type}): {message}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_errors_tell_a_refused_request_from_a_failure() {
        let refused = function_error(
            "Unhandled",
            br#"{"errorType":"BadRequest","errorMessage":"invalid request: no dead letter 9"}"#,
        );
        assert!(matches!(refused, CallError::BadRequest(m) if m.contains("no dead letter 9")));
        let down = function_error(
            "Unhandled",
            br#"{"errorType":"DatabaseUnavailable","errorMessage":"database unavailable"}"#,
        );
        assert!(matches!(down, CallError::Unavailable(m) if m.contains("DatabaseUnavailable")));
        assert!(matches!(
            function_error("Unhandled", b"not json"),
            CallError::Unavailable(m) if m.contains("not json")
        ));
    }
}

/// How long one step of a job runs in the backend: through the operator function each step is
/// one Invoke, answered well within its timeout, and progress shows between steps.
pub const JOB_STEP_SECONDS: u64 = 5;

#[derive(serde::Deserialize)]
struct JobAnswer {
    job: shared::store::operator_jobs::Job,
}

impl Backend {
    /// Runs a started job a step at a time until it is no longer running (finished, or
    /// aborted), telling `each_step` where it stands after each; the job as it ended. A step
    /// that fails ends the run with its error; the job stays running where it stopped, and
    /// `run_job` resumes it.
    pub async fn run_job(
        &self,
        job_id: i64,
        mut each_step: impl FnMut(&shared::store::operator_jobs::Job),
    ) -> Result<shared::store::operator_jobs::Job, CallError> {
        let step = OperatorRequest::RunJob {
            job_id,
            seconds: Some(JOB_STEP_SECONDS),
        };
        loop {
            let job = self.call::<JobAnswer>(&step).await?.job;
            each_step(&job);
            if job.status != "running" {
                return Ok(job);
            }
        }
    }
}
