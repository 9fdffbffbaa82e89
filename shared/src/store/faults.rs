//! The fault drill's writes: what each fault class does to the tables, and the clock that ages
//! them. Compiled only with the `drill` feature (the `hookctl` binary); no deployed function
//! links it. Every statement runs in the drill's own scratch schema (the pool's search_path),
//! never against the product's data.

use sqlx::{PgExecutor, PgPool};

use super::StoreError;

/// A drainer killed mid-batch: claims up to `limit` ready events in a transaction (locking
/// their queue and event rows, as the drain does), then its backend is terminated before it
/// commits. Returns how many it had claimed.
pub async fn kill_drainer_mid_batch(pool: &PgPool, limit: i64) -> Result<usize, StoreError> {
    let mut victim = pool.acquire().await?.detach();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut victim)
        .await?;
    sqlx::query("BEGIN").execute(&mut victim).await?;
    let claimed = super::event_queue::claim(&mut victim, limit).await?.len();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(pool)
        .await?;
    // The connection is dead; dropping it is all that is left.
    drop(victim);
    Ok(claimed)
}

/// A lost queue row: pending events whose `event_queue` row is gone.
pub async fn delete_queue_rows(
    executor: impl PgExecutor<'_>,
    external_ids: &[String],
) -> Result<u64, StoreError> {
    Ok(
        sqlx::query("DELETE FROM event_queue WHERE external_id = ANY($1)")
            .bind(external_ids)
            .execute(executor)
            .await?
            .rows_affected(),
    )
}

/// A deleted effect: the projection row of an entity.
pub async fn delete_entity(
    executor: impl PgExecutor<'_>,
    entity_id: &str,
) -> Result<u64, StoreError> {
    Ok(sqlx::query("DELETE FROM entities WHERE entity_id = $1")
        .bind(entity_id)
        .execute(executor)
        .await?
        .rows_affected())
}

/// A deleted outbox row: the announcement the event that last changed `entity_id` wrote.
/// Returns that event's id.
pub async fn delete_latest_outbox_row(
    executor: impl PgExecutor<'_>,
    entity_id: &str,
) -> Result<Option<String>, StoreError> {
    const SQL: &str = "DELETE FROM outbox AS o USING entities AS x \
         WHERE x.entity_id = $1 AND o.tenant_id = x.tenant_id AND o.external_id = x.last_event_id \
           AND o.action = 'entity.changed' RETURNING o.external_id";
    Ok(sqlx::query_scalar(SQL)
        .bind(entity_id)
        .fetch_optional(executor)
        .await?)
}

/// The statements that age every stored timestamp by an interval, as if that much time had
/// gone by: one UPDATE per table with timestamp columns, built from the catalog of the current
/// schema (identifiers from the catalog, quoted; the interval is a bind parameter).
pub async fn time_machine(executor: impl PgExecutor<'_>) -> Result<Vec<String>, StoreError> {
    const SQL: &str = "SELECT c.table_name::text, string_agg(format('%I = %I - $1::interval', c.column_name, c.column_name), ', ' ORDER BY c.column_name) \
         FROM information_schema.columns AS c \
         JOIN information_schema.tables AS t USING (table_schema, table_name) \
         WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE' \
           AND c.data_type = 'timestamp with time zone' AND c.table_name NOT LIKE '\\_sqlx%' \
         GROUP BY c.table_name ORDER BY c.table_name";
    let rows: Vec<(String, String)> = sqlx::query_as(SQL).fetch_all(executor).await?;
    Ok(rows
        .into_iter()
        .map(|(table, set)| format!("UPDATE {} SET {set}", quote_ident(&table)))
        .collect())
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Ages the database by `seconds` with the statements of [`time_machine`].
pub async fn age(pool: &PgPool, statements: &[String], seconds: f64) -> Result<(), StoreError> {
    let interval = format!("{seconds} seconds");
    for statement in statements {
        sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
            .bind(&interval)
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Seconds from now back to the start of the current hour, by the database's clock.
pub async fn seconds_into_hour(executor: impl PgExecutor<'_>) -> Result<f64, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM now() - date_trunc('hour', now()))::float8")
            .fetch_one(executor)
            .await?,
    )
}

/// Vacuum starvation: a session that opens a transaction, takes a snapshot and sits idle in it.
/// It holds back every vacuum of the database until it ends; dropping the returned connection
/// ends it.
pub async fn open_idle_transaction(pool: &PgPool) -> Result<sqlx::PgConnection, StoreError> {
    let mut conn = pool.acquire().await?.detach();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut conn)
        .await?;
    sqlx::query("SELECT count(*) FROM webhook_events")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// Creates the drill's scratch schema (dropping a leftover one of the same name).
pub async fn create_schema(pool: &PgPool, schema: &str) -> Result<(), StoreError> {
    drop_schema(pool, schema).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {}",
        quote_ident(schema)
    )))
    .execute(pool)
    .await?;
    Ok(())
}

pub async fn drop_schema(pool: &PgPool, schema: &str) -> Result<(), StoreError> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        quote_ident(schema)
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// How many of `external_ids` are processed.
pub async fn processed(
    executor: impl PgExecutor<'_>,
    external_ids: &[String],
) -> Result<i64, StoreError> {
    const SQL: &str =
        "SELECT count(*) FROM webhook_events WHERE external_id = ANY($1) AND status = 'processed'";
    Ok(sqlx::query_scalar(SQL)
        .bind(external_ids)
        .fetch_one(executor)
        .await?)
}

/// Rows stored for `external_ids`, and the deliveries they counted.
pub async fn stored(
    executor: impl PgExecutor<'_>,
    external_ids: &[String],
) -> Result<(i64, i64), StoreError> {
    const SQL: &str = "SELECT count(*), COALESCE(sum(delivery_count), 0)::bigint FROM webhook_events WHERE external_id = ANY($1)";
    Ok(sqlx::query_as(SQL)
        .bind(external_ids)
        .fetch_one(executor)
        .await?)
}

/// Every projected entity and the version it holds.
pub async fn entity_versions(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<(String, i64)>, StoreError> {
    const SQL: &str = "SELECT entity_id, version FROM entities ORDER BY entity_id";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// Whether the outbox holds `action` for the event.
pub async fn has_outbox_row(
    executor: impl PgExecutor<'_>,
    external_id: &str,
    action: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "SELECT EXISTS (SELECT 1 FROM outbox WHERE external_id = $1 AND action = $2)";
    Ok(sqlx::query_scalar(SQL)
        .bind(external_id)
        .bind(action)
        .fetch_one(executor)
        .await?)
}

/// Outbox rows not delivered (pending, failed, or discarded by an operator).
pub async fn undelivered(executor: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    const SQL: &str = "SELECT count(*) FROM outbox WHERE status <> 'delivered'";
    Ok(sqlx::query_scalar(SQL).fetch_one(executor).await?)
}
