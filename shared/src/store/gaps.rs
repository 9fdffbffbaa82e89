//! Gap detection and backfill: `gap_watermarks`, `gap_candidates`, `tombstones`.

use sqlx::PgExecutor;

use super::StoreError;

/// A sequence source's progress: every number at or below `contiguous_through` is stored or
/// tombstoned; every number at or below `examined_through` is stored, tombstoned or a gap
/// candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct Watermark {
    pub contiguous_through: i64,
    pub examined_through: i64,
}

/// The source's watermark; `None` when it has none yet.
pub async fn watermark(
    executor: impl PgExecutor<'_>,
    source_id: &str,
) -> Result<Option<Watermark>, StoreError> {
    const SQL: &str =
        "SELECT contiguous_through, examined_through FROM gap_watermarks WHERE source_id = $1";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .fetch_optional(executor)
        .await?)
}

/// Moves the watermark up (never down); `advanced_at` records when `contiguous_through` last
/// rose.
pub async fn raise_watermark(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    to: Watermark,
) -> Result<(), StoreError> {
    const SQL: &str = "INSERT INTO gap_watermarks (source_id, contiguous_through, examined_through) VALUES ($1, $2, $3) \
         ON CONFLICT (source_id) DO UPDATE SET \
             contiguous_through = GREATEST(gap_watermarks.contiguous_through, EXCLUDED.contiguous_through), \
             examined_through = GREATEST(gap_watermarks.examined_through, EXCLUDED.examined_through), \
             advanced_at = CASE WHEN EXCLUDED.contiguous_through > gap_watermarks.contiguous_through \
                                THEN now() ELSE gap_watermarks.advanced_at END, \
             updated_at = now()";
    sqlx::query(SQL)
        .bind(source_id)
        .bind(to.contiguous_through)
        .bind(to.examined_through.max(to.contiguous_through))
        .execute(executor)
        .await?;
    Ok(())
}

/// The lowest sequence number of the source whose gap candidate is still open (an index
/// endpoint): the contiguous watermark stands just below it.
pub async fn lowest_open_candidate(
    executor: impl PgExecutor<'_>,
    source_id: &str,
) -> Result<Option<i64>, StoreError> {
    const SQL: &str = "SELECT min(sequence) FROM gap_candidates \
         WHERE source_id = $1 AND status = 'open' AND sequence IS NOT NULL";
    Ok(sqlx::query_scalar(SQL)
        .bind(source_id)
        .fetch_one(executor)
        .await?)
}

/// The lowest sequence number stored for the source (an index endpoint).
pub async fn first_sequence(
    executor: impl PgExecutor<'_>,
    source_id: &str,
) -> Result<Option<i64>, StoreError> {
    const SQL: &str = "SELECT min(provider_sequence) FROM webhook_events \
         WHERE source_id = $1 AND provider_sequence IS NOT NULL";
    Ok(sqlx::query_scalar(SQL)
        .bind(source_id)
        .fetch_one(executor)
        .await?)
}

/// A run of missing sequence numbers, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct SequenceGap {
    pub gap_from: i64,
    pub gap_to: i64,
}

/// What one window of a source's sequence holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceWindow {
    /// The missing numbers below `highest`.
    pub gaps: Vec<SequenceGap>,
    /// The highest number present (stored or tombstoned) in the window.
    pub highest: Option<i64>,
    /// Some number above the window is present: everything missing in the window is a gap,
    /// up to its top.
    pub present_above: bool,
}

/// The gaps in `(after, up_to]` of what is present: stored events and tombstones of the
/// source. Events are read in sequence order straight off the `(source_id, provider_sequence)`
/// index with `lead()` (no sort, no hash: cost follows the window, never the table); the few
/// tombstones of the window are merged in afterwards. Also says the highest sequence present
/// in the window and whether anything above it is present (two index probes). Nothing above
/// the highest present number is a gap yet: it may simply not have been sent.
///
/// One statement, so the gaps, the window's ends and the tombstones come from one snapshot:
/// an event committed halfway can neither hide a gap nor let the watermark pass one.
pub async fn sequence_gaps(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    after: i64,
    up_to: i64,
) -> Result<SequenceWindow, StoreError> {
    const SQL: &str = "SELECT min(seq), max(seq), \
             coalesce(array_agg(seq + 1 ORDER BY seq) FILTER (WHERE next > seq + 1), '{}'), \
             coalesce(array_agg(next - 1 ORDER BY seq) FILTER (WHERE next > seq + 1), '{}'), \
             (SELECT coalesce(array_agg(sequence ORDER BY sequence), '{}') FROM tombstones \
                WHERE source_id = $1 AND sequence > $2 AND sequence <= $3), \
             EXISTS (SELECT 1 FROM webhook_events WHERE source_id = $1 AND provider_sequence > $3) \
                OR EXISTS (SELECT 1 FROM tombstones WHERE source_id = $1 AND sequence > $3) \
         FROM ( \
             SELECT provider_sequence AS seq, lead(provider_sequence) OVER (ORDER BY provider_sequence) AS next \
             FROM webhook_events WHERE source_id = $1 AND provider_sequence > $2 AND provider_sequence <= $3) AS w";
    type Row = (Option<i64>, Option<i64>, Vec<i64>, Vec<i64>, Vec<i64>, bool);
    let (min, max, from, to, tombstoned, present_above): Row = sqlx::query_as(SQL)
        .bind(source_id)
        .bind(after)
        .bind(up_to)
        .fetch_one(executor)
        .await?;
    let interior: Vec<SequenceGap> = from
        .into_iter()
        .zip(to)
        .map(|(gap_from, gap_to)| SequenceGap { gap_from, gap_to })
        .collect();
    let (gaps, highest) = merge_gaps(after, min.zip(max), &interior, &tombstoned);
    Ok(SequenceWindow {
        gaps,
        highest,
        present_above,
    })
}

/// The missing numbers of `(after, highest]`, as ranges, where present = events (spanning
/// `events` = (min, max) minus the `interior` gaps between consecutive events) ∪ `tombstoned`
/// (sorted); `highest` is the largest present number.
pub fn merge_gaps(
    after: i64,
    events: Option<(i64, i64)>,
    interior: &[SequenceGap],
    tombstoned: &[i64],
) -> (Vec<SequenceGap>, Option<i64>) {
    let highest = match (events.map(|(_, max)| max), tombstoned.last().copied()) {
        (Some(a), Some(b)) => a.max(b),
        (a, b) => match a.or(b) {
            Some(h) => h,
            None => return (Vec::new(), None),
        },
    };
    // What the events leave missing in (after, highest].
    let mut missing = Vec::new();
    match events {
        None => missing.push(SequenceGap {
            gap_from: after + 1,
            gap_to: highest,
        }),
        Some((min, max)) => {
            missing.push(SequenceGap {
                gap_from: after + 1,
                gap_to: min - 1,
            });
            missing.extend_from_slice(interior);
            missing.push(SequenceGap {
                gap_from: max + 1,
                gap_to: highest,
            });
        }
    }
    // Minus the tombstones.
    let mut gaps = Vec::new();
    for range in missing.into_iter().filter(|r| r.gap_from <= r.gap_to) {
        let mut from = range.gap_from;
        for &t in tombstoned
            .iter()
            .filter(|t| (range.gap_from..=range.gap_to).contains(*t))
        {
            if t > from {
                gaps.push(SequenceGap {
                    gap_from: from,
                    gap_to: t - 1,
                });
            }
            from = t + 1;
        }
        if from <= range.gap_to {
            gaps.push(SequenceGap {
                gap_from: from,
                gap_to: range.gap_to,
            });
        }
    }
    (gaps, Some(highest))
}

/// The textbook anti-join, kept as the benchmark's baseline: every expected ID of the window
/// left-joined against the whole primary key. Its cost follows the table, not the window.
pub async fn textbook_missing(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    id_template: &str,
    from: i64,
    to: i64,
) -> Result<Vec<i64>, StoreError> {
    const SQL: &str = "SELECT g FROM generate_series($3::bigint, $4::bigint) AS g \
         LEFT JOIN webhook_events AS e ON e.tenant_id = $1 AND e.external_id = replace($2, '{seq}', g::text) \
         LEFT JOIN tombstones AS t ON t.tenant_id = $1 AND t.external_id = replace($2, '{seq}', g::text) \
         WHERE e.external_id IS NULL AND t.external_id IS NULL ORDER BY g";
    Ok(sqlx::query_scalar(SQL)
        .bind(tenant_id)
        .bind(id_template)
        .bind(from)
        .bind(to)
        .fetch_all(executor)
        .await?)
}

/// Records missing sequence ranges as candidates (IDs from the template), except IDs already
/// tombstoned (a primary-key probe each). Existing candidates are kept as they are. Returns how
/// many are new.
pub async fn add_sequence_candidates(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    id_template: &str,
    gaps: &[SequenceGap],
) -> Result<u64, StoreError> {
    const SQL: &str = "INSERT INTO gap_candidates (tenant_id, external_id, source_id, sequence) \
         SELECT $1, id, $2, s \
         FROM unnest($4::bigint[], $5::bigint[]) AS r(gap_from, gap_to), generate_series(r.gap_from, r.gap_to) AS s, \
              LATERAL (SELECT replace($3, '{seq}', s::text) AS id) AS i \
         WHERE NOT EXISTS (SELECT 1 FROM tombstones AS t WHERE t.tenant_id = $1 AND t.external_id = i.id) \
         ON CONFLICT (tenant_id, external_id) DO NOTHING";
    let from: Vec<i64> = gaps.iter().map(|g| g.gap_from).collect();
    let to: Vec<i64> = gaps.iter().map(|g| g.gap_to).collect();
    Ok(sqlx::query(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(id_template)
        .bind(from)
        .bind(to)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Records listed IDs that are neither stored nor tombstoned (primary-key probes, one per
/// listed ID). Returns how many are new.
pub async fn add_listed_candidates(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    ids: &[String],
) -> Result<u64, StoreError> {
    const SQL: &str = "INSERT INTO gap_candidates (tenant_id, external_id, source_id) \
         SELECT $1, id, $2 FROM unnest($3::text[]) AS id \
         WHERE NOT EXISTS (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = $1 AND e.external_id = id) \
           AND NOT EXISTS (SELECT 1 FROM tombstones AS t WHERE t.tenant_id = $1 AND t.external_id = id) \
         ON CONFLICT (tenant_id, external_id) DO NOTHING";
    Ok(sqlx::query(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(ids)
        .execute(executor)
        .await?
        .rows_affected())
}

/// Records the events a GitHub hook delivered (GUID, newest delivery id) that are neither stored
/// nor tombstoned, each with the delivery to ask GitHub to redeliver; an open candidate takes
/// the newest delivery id. Returns how many are new.
pub async fn add_redeliverable_candidates(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    events: &[(String, i64)],
) -> Result<u64, StoreError> {
    const SQL: &str = "WITH added AS ( \
             INSERT INTO gap_candidates AS c (tenant_id, external_id, source_id, provider_ref) \
             SELECT $1, l.guid, $2, l.delivery_id::text FROM unnest($3::text[], $4::bigint[]) AS l(guid, delivery_id) \
             WHERE NOT EXISTS (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = $1 AND e.external_id = l.guid) \
               AND NOT EXISTS (SELECT 1 FROM tombstones AS t WHERE t.tenant_id = $1 AND t.external_id = l.guid) \
             ON CONFLICT (tenant_id, external_id) DO UPDATE SET provider_ref = EXCLUDED.provider_ref \
             WHERE c.status = 'open' AND c.source_id = EXCLUDED.source_id \
             RETURNING xmax = 0 AS inserted) \
         SELECT count(*) FILTER (WHERE inserted) FROM added";
    let guids: Vec<&str> = events.iter().map(|(g, _)| g.as_str()).collect();
    let ids: Vec<i64> = events.iter().map(|(_, id)| *id).collect();
    let new: i64 = sqlx::query_scalar(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(guids)
        .bind(ids)
        .fetch_one(executor)
        .await?;
    Ok(u64::try_from(new).unwrap_or(0))
}

/// Open candidates with a delivery to redeliver, past the grace period and not asked for within
/// it, oldest first; before them, those an operator asked to backfill now
/// ([`request_backfill`]), grace or not.
pub async fn due_redeliveries(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    grace_seconds: f64,
    limit: i64,
) -> Result<Vec<Candidate>, StoreError> {
    const SQL: &str = "SELECT tenant_id, external_id, sequence, provider_ref FROM gap_candidates \
         WHERE source_id = $1 AND status = 'open' AND provider_ref IS NOT NULL \
           AND (first_seen_at <= now() - make_interval(secs => $2) OR backfill_requested_at IS NOT NULL) \
           AND (redelivery_requested_at IS NULL OR redelivery_requested_at <= now() - make_interval(secs => $2) \
                OR backfill_requested_at > redelivery_requested_at) \
         ORDER BY backfill_requested_at IS NULL, first_seen_at, external_id LIMIT $3";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .bind(grace_seconds)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// The provider accepted to deliver the candidate's event again.
pub async fn mark_redelivery_requested(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE gap_candidates SET redelivery_requested_at = now(), last_checked_at = now(), \
             attempts = attempts + 1, last_error = NULL \
         WHERE tenant_id = $1 AND external_id = $2";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .execute(executor)
        .await?;
    Ok(())
}

/// Closes open candidates whose event arrived meanwhile: by itself (`arrived`), or after backfill
/// asked the provider to deliver it again (`redelivered`). A delivery kept as an anomaly instead
/// of an event (a body replayed under this id, an id stored under another source) arrived too:
/// asking again would bring the same answer.
pub async fn close_arrived(
    executor: impl PgExecutor<'_>,
    source_id: &str,
) -> Result<u64, StoreError> {
    const SQL: &str = "UPDATE gap_candidates AS c \
         SET status = CASE WHEN c.redelivery_requested_at IS NULL THEN 'arrived' ELSE 'redelivered' END, \
             last_checked_at = now() \
         WHERE c.source_id = $1 AND c.status = 'open' \
           AND (EXISTS (SELECT 1 FROM webhook_events AS e WHERE e.tenant_id = c.tenant_id AND e.external_id = c.external_id) \
                OR (c.sequence IS NOT NULL AND EXISTS (SELECT 1 FROM webhook_events AS e \
                    WHERE e.source_id = c.source_id AND e.provider_sequence = c.sequence)) \
                OR EXISTS (SELECT 1 FROM ingest_anomalies AS a WHERE a.tenant_id = c.tenant_id \
                           AND a.external_id = c.external_id AND a.kind IN ('replayed_body', 'source_collision')))";
    Ok(sqlx::query(SQL)
        .bind(source_id)
        .execute(executor)
        .await?
        .rows_affected())
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Candidate {
    pub tenant_id: String,
    pub external_id: String,
    pub sequence: Option<i64>,
    /// What the provider acts on to fill the gap (GitHub: the delivery to redeliver).
    pub provider_ref: Option<String>,
}

/// Open candidates older than the grace period, oldest first.
/// Open candidates past their grace period, oldest first; before them, those an operator asked
/// to backfill now ([`request_backfill`]), grace or not.
pub async fn due_candidates(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    grace_seconds: f64,
    limit: i64,
) -> Result<Vec<Candidate>, StoreError> {
    const SQL: &str = "SELECT tenant_id, external_id, sequence, provider_ref FROM gap_candidates \
         WHERE source_id = $1 AND status = 'open' \
           AND (first_seen_at <= now() - make_interval(secs => $2) OR backfill_requested_at IS NOT NULL) \
         ORDER BY backfill_requested_at IS NULL, first_seen_at, external_id LIMIT $3";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .bind(grace_seconds)
        .bind(limit)
        .fetch_all(executor)
        .await?)
}

/// Open candidates still inside their grace period.
pub async fn waiting_candidates(
    executor: impl PgExecutor<'_>,
    source_id: &str,
    grace_seconds: f64,
) -> Result<i64, StoreError> {
    const SQL: &str = "SELECT count(*) FROM gap_candidates \
         WHERE source_id = $1 AND status = 'open' AND first_seen_at > now() - make_interval(secs => $2) \
           AND backfill_requested_at IS NULL";
    Ok(sqlx::query_scalar(SQL)
        .bind(source_id)
        .bind(grace_seconds)
        .fetch_one(executor)
        .await?)
}

/// An operator asks for the open gap `(tenant_id, external_id)` of `source_id` to be fetched
/// by the next backfill pass, without waiting out its grace period. Returns whether such an
/// open gap exists.
pub async fn request_backfill(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    external_id: &str,
) -> Result<BackfillAsk, StoreError> {
    // Refused for a source whose gaps have no API to be fetched from (a sequence without one,
    // Xero's): its gap is settled by an operator instead.
    const SQL: &str = "WITH candidate AS (SELECT c.tenant_id, c.external_id, \
                 NOT (s.gap_strategy IS NOT NULL AND s.api_base_url IS NULL) AS fetchable \
             FROM gap_candidates AS c JOIN sources AS s USING (source_id) \
             WHERE c.tenant_id = $1 AND c.source_id = $2 AND c.external_id = $3 AND c.status = 'open'), \
         asked AS (UPDATE gap_candidates AS c SET backfill_requested_at = now() FROM candidate AS k \
             WHERE k.fetchable AND c.tenant_id = k.tenant_id AND c.external_id = k.external_id RETURNING 1) \
         SELECT (SELECT fetchable FROM candidate), EXISTS (SELECT 1 FROM asked)";
    let (fetchable, asked): (Option<bool>, bool) = sqlx::query_as(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(external_id)
        .fetch_one(executor)
        .await?;
    Ok(match (fetchable, asked) {
        (_, true) => BackfillAsk::Requested,
        (Some(false), _) => BackfillAsk::NoProviderApi,
        _ => BackfillAsk::NotOpen,
    })
}

/// What asking for a gap to be fetched now came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackfillAsk {
    /// The next backfill pass fetches it.
    Requested,
    /// No open gap of that id and source.
    NotOpen,
    /// Its source has no provider API to fetch it from (a sequence only found and alarmed).
    NoProviderApi,
}

pub async fn mark_backfilled(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE gap_candidates SET status = 'backfilled', last_checked_at = now(), attempts = attempts + 1, last_error = NULL \
         WHERE tenant_id = $1 AND external_id = $2";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .execute(executor)
        .await?;
    Ok(())
}

pub async fn record_fetch_error(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    external_id: &str,
    error: &str,
) -> Result<(), StoreError> {
    const SQL: &str = "UPDATE gap_candidates SET last_checked_at = now(), attempts = attempts + 1, last_error = $3 \
         WHERE tenant_id = $1 AND external_id = $2";
    sqlx::query(SQL)
        .bind(tenant_id)
        .bind(external_id)
        .bind(error)
        .execute(executor)
        .await?;
    Ok(())
}

/// Tombstones an ID (idempotent) and closes its candidate, in one statement. Returns whether a
/// new tombstone was written.
pub async fn tombstone(
    executor: impl PgExecutor<'_>,
    tenant_id: &str,
    source_id: &str,
    external_id: &str,
    sequence: Option<i64>,
    reason: &str,
    created_by: &str,
) -> Result<bool, StoreError> {
    const SQL: &str = "WITH t AS ( \
             INSERT INTO tombstones (tenant_id, external_id, source_id, sequence, reason, created_by) \
             VALUES ($1, $3, $2, $4, $5, $6) ON CONFLICT (tenant_id, external_id) DO NOTHING RETURNING 1), \
         c AS ( \
             UPDATE gap_candidates SET status = 'tombstoned', last_checked_at = now() \
             WHERE tenant_id = $1 AND external_id = $3 AND status = 'open') \
         SELECT count(*) FROM t";
    let written: i64 = sqlx::query_scalar(SQL)
        .bind(tenant_id)
        .bind(source_id)
        .bind(external_id)
        .bind(sequence)
        .bind(reason)
        .bind(created_by)
        .fetch_one(executor)
        .await?;
    Ok(written > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The merge agrees with the naive definition: every number of (after, highest] that is
        /// neither an event nor a tombstone, and nothing else.
        #[test]
        fn merged_gaps_are_exactly_the_missing_numbers(
            events in proptest::collection::btree_set(1i64..80, 0..40),
            tombstones in proptest::collection::btree_set(1i64..80, 0..10),
        ) {
            let after = 0;
            let ev: Vec<i64> = events.iter().copied().collect();
            let interior: Vec<SequenceGap> = ev.windows(2).filter(|w| w[1] > w[0] + 1)
                .map(|w| SequenceGap { gap_from: w[0] + 1, gap_to: w[1] - 1 }).collect();
            let bounds = ev.first().copied().zip(ev.last().copied());
            let ts: Vec<i64> = tombstones.iter().copied().collect();
            let (gaps, highest) = merge_gaps(after, bounds, &interior, &ts);
            let expected_highest = events.iter().chain(tombstones.iter()).max().copied();
            prop_assert_eq!(highest, expected_highest);
            let got: Vec<i64> = gaps.iter().flat_map(|g| g.gap_from..=g.gap_to).collect();
            let want: Vec<i64> = (after + 1..=expected_highest.unwrap_or(after))
                .filter(|n| !events.contains(n) && !tombstones.contains(n)).collect();
            prop_assert_eq!(got, want);
        }
    }
}

/// An open gap: an ID the provider sent or listed that has not arrived.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct OpenGap {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub sequence: Option<i64>,
    pub first_seen_at: chrono::DateTime<chrono::Utc>,
    /// Still inside its source's grace period (late events are normal): backfill leaves it.
    pub in_grace: bool,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// When an operator asked for it to be fetched by the next pass, grace or not.
    #[serde(default)]
    pub backfill_requested_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Open gaps, oldest first, optionally of one source.
pub async fn open_gaps(
    executor: impl PgExecutor<'_>,
    source_id: Option<&str>,
    limit: i64,
) -> Result<Vec<OpenGap>, StoreError> {
    const SQL: &str = "SELECT g.tenant_id, g.external_id, g.source_id, g.sequence, g.first_seen_at, \
                g.first_seen_at > now() - make_interval(secs => s.gap_grace_seconds) AS in_grace, \
                g.attempts, g.last_error, g.backfill_requested_at \
         FROM gap_candidates AS g JOIN sources AS s USING (source_id) \
         WHERE g.status = 'open' AND ($1::text IS NULL OR g.source_id = $1) \
         ORDER BY g.first_seen_at, g.external_id LIMIT $2";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .bind(limit.clamp(1, 100_000))
        .fetch_all(executor)
        .await?)
}

/// Open gaps per source (in grace or not), read off the open gaps' partial index.
pub async fn count_open_by_source(
    executor: impl PgExecutor<'_>,
) -> Result<Vec<(String, i64)>, StoreError> {
    const SQL: &str = "SELECT source_id, count(*) FROM gap_candidates WHERE status = 'open' \
         GROUP BY source_id ORDER BY source_id";
    Ok(sqlx::query_as(SQL).fetch_all(executor).await?)
}

/// Open gaps backfill has had its chance at: past their source's grace period by more than
/// `allowance_seconds` (a few backfill passes). Younger ones are normal and being handled.
pub async fn count_open_past_grace(
    executor: impl PgExecutor<'_>,
    allowance_seconds: f64,
    buffer_hold_seconds: f64,
) -> Result<OpenGapCounts, StoreError> {
    const SQL: &str = "SELECT \
             count(*) FILTER (WHERE g.first_seen_at < now() - make_interval(secs => s.gap_grace_seconds + $1)), \
             count(*) FILTER (WHERE g.first_seen_at >= now() - make_interval(secs => s.gap_grace_seconds + $1)), \
             count(*) FILTER (WHERE g.first_seen_at < now() - make_interval(secs => s.gap_grace_seconds + $1) \
                                AND g.first_seen_at >= now() - make_interval(secs => GREATEST(s.gap_grace_seconds, $2) + $1)) \
         FROM gap_candidates AS g JOIN sources AS s USING (source_id) WHERE g.status = 'open'";
    let (past_grace, in_grace, within_buffer_hold) = sqlx::query_as(SQL)
        .bind(allowance_seconds)
        .bind(buffer_hold_seconds)
        .fetch_one(executor)
        .await?;
    Ok(OpenGapCounts {
        past_grace,
        in_grace,
        within_buffer_hold,
    })
}

/// Open gaps by how long they have waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenGapCounts {
    /// Past their source's grace period plus the allowance.
    pub past_grace: i64,
    /// Still within it.
    pub in_grace: i64,
    /// Of `past_grace`, those within the buffer's hold instead (the longer of the grace period
    /// and the hold, plus the allowance): what backfill does not judge yet while the SQS buffer
    /// holds deliveries.
    pub within_buffer_hold: i64,
}

/// A tombstone: an ID declared never to arrive.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct Tombstone {
    pub tenant_id: String,
    pub external_id: String,
    pub source_id: String,
    pub sequence: Option<i64>,
    pub reason: String,
    /// `backfill` (the provider said not found) or `operator:<who>`.
    pub created_by: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Tombstones, newest first, optionally of one source.
pub async fn list_tombstones(
    executor: impl PgExecutor<'_>,
    source_id: Option<&str>,
    limit: i64,
) -> Result<Vec<Tombstone>, StoreError> {
    const SQL: &str = "SELECT tenant_id, external_id, source_id, sequence, reason, created_by, created_at \
         FROM tombstones WHERE ($1::text IS NULL OR source_id = $1) \
         ORDER BY created_at DESC, external_id LIMIT $2";
    Ok(sqlx::query_as(SQL)
        .bind(source_id)
        .bind(limit.clamp(1, 100_000))
        .fetch_all(executor)
        .await?)
}
