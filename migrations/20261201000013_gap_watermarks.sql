-- Gap detection never stalls.
--
-- examined_through: how far up a sequence source's numbers have been examined. Each pass
-- examines new ground above it, whatever the watermark, so a gap that waits (grace period,
-- failing fetch) no longer hides the gaps above `watermark + window`. Every missing number at
-- or below it is a gap candidate; the contiguous watermark is just below the lowest one still
-- open. advanced_at: when contiguous_through last rose (the stalled-watermark check reads it).
ALTER TABLE gap_watermarks
    ADD COLUMN examined_through bigint,
    ADD COLUMN advanced_at timestamptz NOT NULL DEFAULT now();
UPDATE gap_watermarks SET examined_through = contiguous_through, advanced_at = updated_at;
ALTER TABLE gap_watermarks ALTER COLUMN examined_through SET NOT NULL;
ALTER TABLE gap_watermarks ADD CONSTRAINT gap_watermarks_examined_above_contiguous
    CHECK (examined_through >= contiguous_through);

-- The lowest open candidate of a source, read off an index endpoint.
CREATE INDEX gap_candidates_open_by_sequence ON gap_candidates (source_id, sequence)
    WHERE status = 'open' AND sequence IS NOT NULL;

-- Tombstones written without a sequence on a sequence source (an operator following the
-- README's example) get the number their ID stands for under the source's id template, so the
-- gap they fill closes.
UPDATE tombstones AS t
SET sequence = substr(t.external_id, length(p.prefix) + 1,
                      length(t.external_id) - length(p.prefix) - length(p.suffix))::bigint
FROM (SELECT source_id, split_part(id_template, '{seq}', 1) AS prefix,
             split_part(id_template, '{seq}', 2) AS suffix
      FROM sources WHERE gap_strategy = 'sequence') AS p
WHERE t.source_id = p.source_id AND t.sequence IS NULL
  AND length(t.external_id) > length(p.prefix) + length(p.suffix)
  AND left(t.external_id, length(p.prefix)) = p.prefix
  AND right(t.external_id, length(p.suffix)) = p.suffix
  AND substr(t.external_id, length(p.prefix) + 1,
             length(t.external_id) - length(p.prefix) - length(p.suffix)) ~ '^(0|[1-9][0-9]{0,17})$';
