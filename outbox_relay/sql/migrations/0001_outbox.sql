-- The outbox table and the indexes its hot paths need.
--
-- Every hot query has its own narrow index, so that claim and finalize cost
-- stays flat however many finished rows the table holds:
--   ready:          pending rows by due time, for the claim's first branch
--   leased:         processing rows by lease end, for expired-lease re-claims and the reaper
--   unfinished_agg: unfinished rows per aggregate, for ordered claims
--   operation_key:  partial unique index; most rows have no key
--   done:           finished rows by completion time, for purge
CREATE TABLE {table} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT jsonb_build_object(),
    operation_key  text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    available_at   timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    lease_owner    text,
    lease_until    timestamptz,
    lease_version  bigint      NOT NULL DEFAULT 0,
    last_error     text,
    done_at        timestamptz,
    -- A row holds a lease exactly while it is processing. Fenced statements rely on
    -- this: they test "lease_until IS NOT NULL" rather than "status = 'processing'"
    -- (see queries.sql, finalize).
    CONSTRAINT {leased_iff_processing} CHECK ((status = 'processing') = (lease_until IS NOT NULL))
) WITH (
    -- A queue table churns: every row is updated twice and later deleted.
    -- Vacuum and analyze it far more often than the defaults would.
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);

CREATE INDEX {ix_ready} ON {table} (available_at, id) WHERE status = 'pending';
CREATE INDEX {ix_leased} ON {table} (lease_until) WHERE status = 'processing';
CREATE INDEX {ix_unfinished_agg} ON {table} (aggregate_type, aggregate_id, id)
    WHERE status IN ('pending', 'processing', 'dead');
CREATE UNIQUE INDEX {ix_operation_key} ON {table} (operation_key) WHERE operation_key IS NOT NULL;
CREATE INDEX {ix_done} ON {table} (done_at) WHERE status = 'done';
