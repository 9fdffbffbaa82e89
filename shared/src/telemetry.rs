//! Logging, set up once per process. JSON lines in Lambda (CloudWatch parses them), readable
//! text locally. Filter with `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,aws_config=warn"));
    let json = std::env::var("AWS_LAMBDA_FUNCTION_NAME").is_ok()
        || std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
    let result = if json {
        // Lambda adds its own timestamp and request id to each line.
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .without_time()
            .try_init()
    } else {
        // Colour only on a terminal: piped or redirected, the fields stay plain `key=value`.
        use std::io::IsTerminal as _;
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .try_init()
    };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}

/// For tests: logs only when `TEST_LOG` is set, so test output stays quiet by default.
pub fn init_for_tests() {
    if std::env::var_os("TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| EnvFilter::new("debug,sqlx=warn")),
            )
            .with_test_writer()
            .try_init();
    }
}
