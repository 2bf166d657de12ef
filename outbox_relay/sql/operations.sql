-- Operator queries: status, dead letters, retention, metrics and grants.
-- Loaded with queries.sql by outbox_relay/sql/queries.py and run only by
-- outbox_relay/store/ops.py; none of them is on the delivery hot path.
--
-- {table} and friends are identifiers filled in with psycopg.sql.Identifier;
-- %(name)s are bound parameters; %(now)s is NULL in production (the database
-- clock decides) and a fixed timestamp in tests that move time.
--
-- The GRANT statements name their grantee as {{role}}: the doubled braces
-- survive the identifier pass in queries.py, and operations.grants() fills
-- the role in with a second psycopg.sql pass. Their comments are printed with
-- them by `outbox-relay grant`, so they are written for the person applying them.

-- name: op_stats
-- The one status query, behind store.stats(), `outbox-relay status` and the
-- metrics gauges. Unfinished rows are counted through their partial indexes.
-- done is counted exactly when %(exact_done_below)s is NULL or the planner's
-- row estimate (reltuples; -1 before the first VACUUM or ANALYZE) is below
-- it, else NULL: the caller then estimates it as reltuples minus the other
-- statuses, because counting millions of done rows on every scrape costs more
-- than the number is worth. The done count is an uncorrelated subquery (an
-- InitPlan), which PostgreSQL runs only when the CASE takes its branch.
-- One statement, so every figure comes from the same snapshot.
--
-- oldest_pending_age_seconds is how long the longest-waiting message has
-- waited for its delivery, from waiting_since (migration 0008): when it
-- became due (created_at, or later with a delay, countdown or eta), or when
-- an operator retried it from dead. A message scheduled for later does not
-- count before then, so the alerts on this age never fire for messages that
-- are on time; one tried before (pending with an attempt, or processing a
-- second one) goes on counting through its backoff, so a receiver that
-- keeps failing shows as a growing age. Rows written before migration 0008
-- have no waiting_since: untried, they count from their due time; tried,
-- from created_at. A parked row (queries.sql, frag_parked) waits behind an
-- earlier one of its aggregate and counts as well. Each status is read
-- through its own partial index, as the counts are.
SELECT s.pending, s.processing,
       CASE WHEN %(exact_done_below)s::float8 IS NULL
              OR coalesce(s.reltuples, -1) < %(exact_done_below)s::float8
            THEN (SELECT count(*) FROM {table} WHERE status = 'done') END AS done,
       s.dead, s.expired_leases, s.oldest_pending_age_seconds, s.reltuples
  FROM (SELECT (SELECT count(*) FROM {table} WHERE status = 'pending') AS pending,
               (SELECT count(*) FROM {table} WHERE status = 'processing') AS processing,
               (SELECT count(*) FROM {table} WHERE status = 'dead') AS dead,
               (SELECT count(*) FROM {table}
                 WHERE status = 'processing'
                   AND lease_until < coalesce(%(now)s::timestamptz, now())) AS expired_leases,
               coalesce(extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - least(
                   -- (No alias on purpose: a table from before migration 0008
                   -- fails with 'column "waiting_since" does not exist', which
                   -- callers turn into "run migrate". The last test is
                   -- frag_parked's, for this unaliased table.)
                   (SELECT min(coalesce(waiting_since,
                                        CASE WHEN attempts > 0
                                               OR available_at > coalesce(%(now)s::timestamptz, now())
                                                                 + interval '1000 years'
                                             THEN created_at
                                             ELSE greatest(created_at, available_at) END))
                      FROM {table}
                     WHERE status = 'pending'
                       AND (attempts > 0
                            OR available_at <= coalesce(%(now)s::timestamptz, now())
                            OR available_at > coalesce(%(now)s::timestamptz, now())
                                              + interval '1000 years')),
                   (SELECT min(coalesce(waiting_since,
                                        CASE WHEN attempts > 1 THEN created_at
                                             ELSE greatest(created_at, available_at) END))
                      FROM {table} WHERE status = 'processing'))), 0)::float8
                   AS oldest_pending_age_seconds,
               (SELECT c.reltuples
                  FROM pg_class AS c
                  JOIN pg_namespace AS n ON n.oid = c.relnamespace
                 WHERE n.nspname = %(schema)s AND c.relname = %(name)s)::float8 AS reltuples
       ) AS s;

-- name: op_get_row
-- One message with every column, for people and tests looking at a row.
SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, operation_key,
       created_at, status, available_at, waiting_since, attempts, lease_owner, lease_until,
       lease_version, last_error, done_at
  FROM {table}
 WHERE id = %(id)s;

-- name: op_done_recently
-- Messages finished (done) within %(within)s of now, for `outbox-relay
-- status`'s rate: a range of the done partial index (done_at), never the
-- whole table. Not in op_stats: the metrics scrape has its own counters for
-- the rate, and at tens of thousands a second a minute's range is a count
-- worth paying for a person's command, not for every scrape.
SELECT count(*)
  FROM {table}
 WHERE status = 'done'
   AND done_at > coalesce(%(now)s::timestamptz, now()) - %(within)s::interval;

-- name: op_parked
-- Rows parked behind an earlier, unfinished message of their aggregate
-- (queries.sql, frag_parked), for `outbox-relay status`: a range of the ready
-- index. Not in op_stats (and so not in every metrics scrape): they are
-- counted as pending there.
SELECT count(*)
  FROM {table} AS o
 WHERE o.status = 'pending'
   AND {frag_parked};

-- name: op_attempts_distribution
-- Attempts spent by the messages still awaiting delivery. Each status walks
-- its own partial index (ready, leased), never the finished rows.
SELECT attempts, count(*) AS messages
  FROM {table}
 WHERE status IN ('pending', 'processing')
 GROUP BY attempts
 ORDER BY attempts;

-- name: frag_dead_match
-- Not a statement: the condition that picks dead rows by DeadFilter (NULL
-- filters match all), written into op_dead_list, op_dead_count,
-- op_dead_retry and op_dead_skip as {frag_dead_match}. %(older_than)s
-- compares created_at (see op_dead_list).
status = 'dead'
AND (%(event_type)s::text IS NULL OR event_type = %(event_type)s::text)
AND (%(aggregate_type)s::text IS NULL OR aggregate_type = %(aggregate_type)s::text)
AND (%(aggregate_id)s::text IS NULL OR aggregate_id = %(aggregate_id)s::text)
AND (%(older_than)s::interval IS NULL
     OR created_at < coalesce(%(now)s::timestamptz, now()) - %(older_than)s::interval);

-- name: frag_dead_picked
-- Not a statement: the dead rows op_dead_retry and op_dead_skip change,
-- locked: %(ids)s, or every row the filters match when it is NULL, oldest id
-- first, at most %(limit)s (NULL: all).
SELECT id
  FROM {table}
 WHERE {frag_dead_match}
   AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
 ORDER BY id
 LIMIT %(limit)s::bigint
   FOR UPDATE;

-- name: op_dead_list
-- Dead messages, oldest id first. NULL filters match all; %(older_than)s
-- compares created_at: the table records when a message was written, not
-- when it died (a dead row's done_at is NULL, and available_at is when its
-- last attempt fell due), so "older than 1h" means written over an hour ago.
-- The same filters as op_dead_count, op_dead_retry and op_dead_skip.
-- The dead rows are gathered first (MATERIALIZED: through the unfinished-rows
-- partial index) and only then sorted. With "ORDER BY id LIMIT n" on the table
-- itself the planner, once dead rows were a fraction of a percent of the
-- table, walked the primary key from the oldest id and filtered out every
-- finished row before the first dead one: 1.16 million rows and 114k buffers
-- for 50 rows of 8,000 dead in a table of 1.2 million (627 ms, against 26 ms).
WITH dead AS MATERIALIZED (
    SELECT id, aggregate_type, aggregate_id, event_type, attempts, lease_version,
           created_at, last_error, operation_key
      FROM {table}
     WHERE {frag_dead_match}
)
SELECT id, aggregate_type, aggregate_id, event_type, attempts, lease_version,
       created_at, last_error, operation_key
  FROM dead
 ORDER BY id
 LIMIT %(limit)s;

-- name: op_retrying_list
-- Messages waiting for another attempt after a failed one (pending with an
-- attempt used, and a last error), the next due first, with when that is:
-- what `outbox-relay retrying` shows an operator who asks why messages are
-- late. Read through the pending rows' partial index (the ready index),
-- filtering the untried out: the whole backlog at worst, an operator's query
-- and not the relay's. No payloads, as dead list.
SELECT id, aggregate_type, aggregate_id, event_type, attempts, created_at,
       extract(epoch FROM available_at - coalesce(%(now)s::timestamptz, now()))::float8,
       last_error
  FROM {table}
 WHERE status = 'pending'
   AND attempts > 0
   AND last_error IS NOT NULL
 ORDER BY available_at, id
 LIMIT %(limit)s;

-- name: op_dead_count
-- How many dead rows op_dead_list's filters match, beyond the page it shows,
-- and what `dead retry|skip --all` asks a person to confirm. The dead rows
-- only, through the unfinished-rows partial index.
SELECT count(*)
  FROM {table}
 WHERE {frag_dead_match};

-- name: op_dead_retry
-- dead -> pending with a fresh attempt budget. %(ids)s NULL means every dead
-- row the filters match, oldest id first, at most %(limit)s (NULL: all).
-- Due now, or with %(spread)s spread evenly over that long in id order (the
-- first now, the last just before now + spread), so a receiver that just
-- recovered is not met by the whole backlog at once; an ordered aggregate's
-- rows stay in their order. Each waits from when it falls due
-- (waiting_since: its time as dead is the dead alert's, and a row scheduled
-- for later does not count before then). The rows are locked and numbered
-- first (FOR UPDATE cannot go with the window functions). lease_version is
-- left alone on purpose: it is the fencing token and must only ever grow.
-- last_error is kept, so the reason it died stays visible until the next
-- attempt writes its own result.
WITH picked AS ({frag_dead_picked}), numbered AS (
    SELECT id,
           coalesce(%(now)s::timestamptz, now())
             + %(spread)s::interval * ((row_number() OVER (ORDER BY id) - 1)::float8
                                       / count(*) OVER ()) AS due
      FROM picked
)
UPDATE {table} AS o
   SET status        = 'pending',
       attempts      = 0,
       available_at  = numbered.due,
       waiting_since = numbered.due
  FROM numbered
 WHERE o.id = numbered.id
   AND o.status = 'dead'
RETURNING o.id;

-- name: op_dead_skip
-- dead -> done without delivering, to unblock an ordered aggregate whose head
-- cannot be sent. last_error says so, because "done" alone would claim the
-- receiver got it; done_at makes the row eligible for purge like any other.
-- %(ids)s NULL means every dead row the filters match, oldest id first, at
-- most %(limit)s (NULL: all), as op_dead_retry. A skipped row marked
-- ordered makes its aggregate's next row due if it was parked (promote).
WITH picked AS ({frag_dead_picked})
UPDATE {table} AS o
   SET status     = 'done',
       done_at    = coalesce(%(now)s::timestamptz, now()),
       last_error = left('skipped by an operator, not delivered; last error: '
                         || coalesce(o.last_error, 'none'), %(max_error)s::int)
  FROM picked
 WHERE o.id = picked.id
   AND o.status = 'dead'
RETURNING o.id, o.ordered;

-- name: op_purge_cutoff
-- Fixed once per purge run, so a long run does not chase rows finished after it began.
SELECT coalesce(%(now)s::timestamptz, now()) - %(older_than)s::interval;

-- name: op_purge_done
-- One bounded batch of retention, oldest first along the done partial index.
-- FOR UPDATE re-checks the WHERE clause on each row it locks, and SKIP LOCKED
-- lets two purges share the work. "id = ANY(ARRAY(subquery))" rather than
-- "id IN (subquery)": with IN the planner may hash the batch and scan the
-- whole table to join it (tests/test_operations.py guards the plan); an
-- array computed first can only be probed through the primary key. The outer
-- DELETE repeats no status test, which could likewise tempt it into the
-- large done index.
DELETE FROM {table}
 WHERE id = ANY(ARRAY(
           SELECT id
             FROM {table}
            WHERE status = 'done'
              AND done_at < %(cutoff)s::timestamptz
            ORDER BY done_at
            LIMIT %(batch)s
              FOR UPDATE SKIP LOCKED));

-- name: op_outbox_tables
-- Every outbox table in the database, for the command line's "no such
-- table" error: a table with its migrations table ({table}_migrations, made
-- by the first migration) beside it in the same schema. pg_class is readable
-- by every role, so a role that may not read the tables still gets the names.
SELECT n.nspname, c.relname
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE c.relkind IN ('r', 'p')
   AND EXISTS (SELECT
                 FROM pg_class AS m
                WHERE m.relnamespace = c.relnamespace
                  AND m.relname = c.relname || '_migrations'
                  AND m.relkind IN ('r', 'p'))
 ORDER BY n.nspname, c.relname;

-- name: op_scrape_timeout
-- Bounds one metrics scrape; transaction-local, so it is safe behind PgBouncer.
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: op_grant_producer
-- Least privilege for application code that calls enqueue(): insert the
-- columns enqueue writes (so it cannot forge a status, lease or attempt
-- count), and read only what the operation-key check needs: the key (ON
-- CONFLICT names it), the id it returns and the content digest it compares
-- (content_hash). Never another message's payload or headers, and nothing
-- to change or delete. NOTIFY and the ordering advisory lock need no grant.
-- The identity column needs no sequence privilege: PostgreSQL does not check
-- one for GENERATED ... AS IDENTITY.
GRANT USAGE ON SCHEMA {schema} TO {{role}};
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, headers, operation_key,
              ordered, available_at, waiting_since, content_hash)
   ON TABLE {table} TO {{role}};
GRANT SELECT (id, operation_key, content_hash) ON TABLE {table} TO {{role}};

-- name: op_grant_relay
-- Least privilege for the relay's workers and beat: read whole rows (they
-- publish the payload), change only the dispatcher's columns (claim, begin,
-- finalize, lease renewal, rescue; UPDATE also covers the claim's FOR
-- UPDATE), delete finished rows (purge), and read which migrations were
-- applied (the start-up check). No INSERT, no change to what a message
-- says (payload, headers, event type, aggregate, key), no DDL.
GRANT USAGE ON SCHEMA {schema} TO {{role}};
GRANT SELECT, DELETE ON TABLE {table} TO {{role}};
GRANT UPDATE (status, available_at, waiting_since, attempts, lease_owner, lease_until,
              lease_version, last_error, done_at, began_version)
   ON TABLE {table} TO {{role}};
GRANT SELECT ON TABLE {migrations} TO {{role}};

-- name: op_grant_operator
-- Least privilege for people and scripts that run `outbox-relay status`,
-- `dead list|retry|skip`, `purge` and the metrics exporter: read every
-- column but the message's content (payload, headers and its digest:
-- `dead list` never shows them), move dead rows back to pending or to done,
-- and delete finished rows. No INSERT, no lease columns, no DDL.
GRANT USAGE ON SCHEMA {schema} TO {{role}};
GRANT SELECT (id, aggregate_type, aggregate_id, event_type, operation_key, created_at, status,
              available_at, waiting_since, attempts, lease_owner, lease_until, lease_version,
              last_error, done_at, ordered)
   ON TABLE {table} TO {{role}};
GRANT UPDATE (status, available_at, waiting_since, attempts, last_error, done_at)
   ON TABLE {table} TO {{role}};
GRANT DELETE ON TABLE {table} TO {{role}};
GRANT SELECT ON TABLE {migrations} TO {{role}};

-- name: op_demo_orders_create
-- `outbox-relay demo`: the shop's own table, beside the demo's outbox in its
-- schema. The demo writes each order and its event in one transaction, as
-- an application would.
CREATE TABLE IF NOT EXISTS {schema}.demo_orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text NOT NULL,
    total_cents integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- name: op_demo_order_insert
INSERT INTO {schema}.demo_orders (customer, total_cents)
VALUES (%(customer)s, %(total_cents)s)
RETURNING id;
