-- Every query outbox-relay runs, by name. Loaded once by outbox_relay/queries.py.
--
-- {table} and friends are identifiers filled in with psycopg.sql.Identifier;
-- %(name)s are bound parameters. Queries that depend on time take %(now)s:
-- NULL in production (the database clock decides), a fixed timestamp in tests
-- that move time without sleeping.

-- name: insert
-- One new message, inside the caller's transaction. A repeated operation key
-- inserts nothing; the caller then compares contents (insert_conflict).
INSERT INTO {table} AS o
       (aggregate_type, aggregate_id, event_type, payload, headers, operation_key, available_at)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s::jsonb,
        %(headers)s::jsonb, %(operation_key)s,
        coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval)
ON CONFLICT (operation_key) WHERE operation_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: insert_conflict
-- The message that already holds an operation key, and whether it means the same thing.
SELECT id,
       (aggregate_type = %(aggregate_type)s AND aggregate_id = %(aggregate_id)s
        AND event_type = %(event_type)s AND payload = %(payload)s::jsonb
        AND headers = %(headers)s::jsonb) AS same
  FROM {table}
 WHERE operation_key = %(operation_key)s;

-- name: advisory_lock
-- A transaction-scoped lock on a text key. Serializes migrations, and
-- producers of one aggregate of an ordered event type (so that id order
-- equals commit order within the aggregate).
SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0));

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS {migrations} (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_migrations
SELECT version FROM {migrations} ORDER BY version;

-- name: record_migration
INSERT INTO {migrations} (version, name) VALUES (%(version)s, %(name)s);

-- name: notify
SELECT pg_notify(%(channel)s, '');

-- name: durable_commit
-- A claim bumps the fencing token; its commit must be durable even on a
-- connection that finalizes with synchronous_commit = off (see Settings.
-- synchronous_finalize): a claim forgotten in a crash could hand out the
-- same lease_version twice.
SET LOCAL synchronous_commit = on;

-- name: reap
-- Rows whose lease expired with no attempts left: the worker died on its last
-- try (a poison message that kills workers never reaches an except branch).
WITH doomed AS (
    SELECT id
      FROM {table}
     WHERE status = 'processing'
       AND lease_until < coalesce(%(now)s::timestamptz, now())
       AND attempts >= %(max_attempts)s
     ORDER BY lease_until
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
   SET status = 'dead',
       last_error = 'lease expired on the last attempt (' || o.attempts
                    || ' of ' || %(max_attempts)s || '); the worker probably crashed',
       lease_owner = NULL,
       lease_until = NULL
  FROM doomed
 WHERE o.id = doomed.id
RETURNING o.id;

-- name: claim
-- Take up to %(batch)s rows: due pending rows and rows whose lease expired.
-- Each branch walks its own partial index; one OR-ed predicate would make
-- the planner walk past finished rows.
WITH ready AS (
    SELECT id
      FROM {table}
     WHERE status = 'pending'
       AND available_at <= coalesce(%(now)s::timestamptz, now())
     ORDER BY available_at, id
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id
      FROM {table}
     WHERE status = 'processing'
       AND lease_until < coalesce(%(now)s::timestamptz, now())
       AND attempts < %(max_attempts)s
     ORDER BY lease_until
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM expired
    UNION ALL
    SELECT id FROM ready
    LIMIT %(batch)s
)
UPDATE {table} AS o
   SET status        = 'processing',
       lease_owner   = %(owner)s,
       lease_until   = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval,
       lease_version = o.lease_version + 1,
       attempts      = o.attempts + 1
  FROM picked
 WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
          o.event_type, o.payload, o.headers, o.operation_key, o.created_at, o.lease_until;

-- name: claim_ordered
-- As claim, but a row of an ordered event type is claimable only when no
-- earlier row of its aggregate (of an ordered type) is unfinished. "dead"
-- counts as unfinished: a dead head blocks its aggregate until a person
-- retries or skips it. %(all_ordered)s orders every event type.
WITH ready AS (
    SELECT o.id
      FROM {table} AS o
     WHERE o.status = 'pending'
       AND o.available_at <= coalesce(%(now)s::timestamptz, now())
       AND (NOT (%(all_ordered)s OR o.event_type = ANY(%(ordered_types)s::text[]))
            OR NOT EXISTS (
                SELECT 1
                  FROM {table} AS prev
                 WHERE prev.aggregate_type = o.aggregate_type
                   AND prev.aggregate_id = o.aggregate_id
                   AND prev.id < o.id
                   AND prev.status IN ('pending', 'processing', 'dead')
                   AND (%(all_ordered)s OR prev.event_type = ANY(%(ordered_types)s::text[]))))
     ORDER BY o.available_at, o.id
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT o.id
      FROM {table} AS o
     WHERE o.status = 'processing'
       AND o.lease_until < coalesce(%(now)s::timestamptz, now())
       AND o.attempts < %(max_attempts)s
       AND (NOT (%(all_ordered)s OR o.event_type = ANY(%(ordered_types)s::text[]))
            OR NOT EXISTS (
                SELECT 1
                  FROM {table} AS prev
                 WHERE prev.aggregate_type = o.aggregate_type
                   AND prev.aggregate_id = o.aggregate_id
                   AND prev.id < o.id
                   AND prev.status IN ('pending', 'processing', 'dead')
                   AND (%(all_ordered)s OR prev.event_type = ANY(%(ordered_types)s::text[]))))
     ORDER BY o.lease_until
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM expired
    UNION ALL
    SELECT id FROM ready
    LIMIT %(batch)s
)
UPDATE {table} AS o
   SET status        = 'processing',
       lease_owner   = %(owner)s,
       lease_until   = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval,
       lease_version = o.lease_version + 1,
       attempts      = o.attempts + 1
  FROM picked
 WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
          o.event_type, o.payload, o.headers, o.operation_key, o.created_at, o.lease_until;

-- name: load_leased
-- The rows of a delivery chunk that are still held under the given versions,
-- with how much lease is left. A missing row means "not mine any more".
SELECT o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
       o.event_type, o.payload, o.headers, o.operation_key, o.created_at,
       o.lease_until,
       extract(epoch FROM o.lease_until - coalesce(%(now)s::timestamptz, now()))::float8
           AS lease_left_seconds,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - o.created_at)::float8
           AS age_seconds
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS v(id, version)
  JOIN {table} AS o
    ON o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL;

-- name: load_leased_one
-- load_leased for one message (the per-message deliver task): plain
-- parameters plan far cheaper than unnest() of one-element arrays.
SELECT o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
       o.event_type, o.payload, o.headers, o.operation_key, o.created_at,
       o.lease_until,
       extract(epoch FROM o.lease_until - coalesce(%(now)s::timestamptz, now()))::float8
           AS lease_left_seconds,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - o.created_at)::float8
           AS age_seconds
  FROM {table} AS o
 WHERE o.id = %(id)s
   AND o.lease_version = %(version)s
   AND o.lease_until IS NOT NULL;

-- name: finalize
-- Fenced finalize of many messages in one statement. A row changes only when
-- it is still held (lease_until IS NOT NULL, which the table's CHECK makes
-- equivalent to status = 'processing') under the caller's lease_version.
-- We test lease_until rather than status on purpose: "status = 'processing'"
-- implies the predicates of the leased and unfinished partial indexes, and
-- with thin statistics the planner may then scan one of those whole indexes
-- instead of probing the primary key (tests/test_plans.py guards this).
UPDATE {table} AS o
   SET status       = v.status,
       available_at = CASE WHEN v.status = 'pending'
                           THEN coalesce(%(now)s::timestamptz, now()) + v.delay
                           ELSE o.available_at END,
       attempts     = o.attempts - v.refund,
       last_error   = v.error,
       done_at      = CASE WHEN v.status = 'done'
                           THEN coalesce(%(now)s::timestamptz, now()) END,
       lease_owner  = NULL,
       lease_until  = NULL
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[], %(statuses)s::text[],
              %(delays)s::interval[], %(refunds)s::int[], %(errors)s::text[])
       AS v(id, version, status, delay, refund, error)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL
RETURNING o.id;

-- name: finalize_one
-- finalize for one message, with plain parameters (see load_leased_one).
-- The same fence: id, lease_version and a live lease.
UPDATE {table} AS o
   SET status       = %(status)s,
       available_at = CASE WHEN %(status)s = 'pending'
                           THEN coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval
                           ELSE o.available_at END,
       attempts     = o.attempts - %(refund)s,
       last_error   = %(error)s,
       done_at      = CASE WHEN %(status)s = 'done'
                           THEN coalesce(%(now)s::timestamptz, now()) END,
       lease_owner  = NULL,
       lease_until  = NULL
 WHERE o.id = %(id)s
   AND o.lease_version = %(version)s
   AND o.lease_until IS NOT NULL
RETURNING o.id;

-- name: extend_lease
-- Fenced lease renewal (heartbeat) for long publishes.
UPDATE {table} AS o
   SET lease_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS v(id, version)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL
RETURNING o.id;

-- name: in_flight
-- Leased-but-unfinished rows, for backpressure (walks the leased index only).
SELECT count(*) FROM {table} WHERE status = 'processing';

-- name: stats
SELECT (SELECT count(*) FROM {table} WHERE status = 'pending') AS pending,
       (SELECT count(*) FROM {table} WHERE status = 'processing') AS processing,
       (SELECT count(*) FROM {table} WHERE status = 'done') AS done,
       (SELECT count(*) FROM {table} WHERE status = 'dead') AS dead,
       (SELECT count(*) FROM {table}
         WHERE status = 'processing'
           AND lease_until < coalesce(%(now)s::timestamptz, now())) AS expired_leases,
       coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - least(
           (SELECT min(created_at) FROM {table} WHERE status = 'pending'),
           (SELECT min(created_at) FROM {table} WHERE status = 'processing'))), 0)::float8
           AS oldest_pending_age_seconds;

-- name: get
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, operation_key,
       created_at, status, available_at, attempts, lease_owner, lease_until,
       lease_version, last_error, done_at
  FROM {table}
 WHERE id = %(id)s;

-- name: listen
-- {channel} is the table's notification channel (OutboxTable.channel).
LISTEN {channel};

-- name: table_exists
-- format('%%I.%%I') quotes both names, so mixed-case names are found as written.
SELECT to_regclass(format('%%I.%%I', %(schema)s::text, %(name)s::text)) IS NOT NULL;
