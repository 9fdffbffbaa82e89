//! Session-level advisory locks: one holder per job across every Lambda environment. Held on
//! one connection for the whole pass (behind RDS Proxy this pins that connection, which is
//! acceptable for one reconcile session).

use sqlx::PgConnection;

use super::StoreError;

/// Takes the lock if free; never waits.
pub async fn try_lock(conn: &mut PgConnection, key: i64) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(conn)
        .await?)
}

pub async fn unlock(conn: &mut PgConnection, key: i64) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .fetch_one(conn)
        .await?)
}
