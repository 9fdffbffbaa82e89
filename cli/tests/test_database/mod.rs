//! The URL of a test's own database (`#[sqlx::test]` hands its connect options), for the
//! `hookctl` binary a test spawns: `DATABASE_URL` as an operator sets it.

use sqlx::postgres::PgConnectOptions;

pub fn url(connect: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        connect.get_username(),
        connect.get_host(),
        connect.get_port(),
        connect.get_database().unwrap()
    )
}
