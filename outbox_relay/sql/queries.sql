-- Every query outbox-relay runs, by name. Loaded once by outbox_relay/sql/queries.py
-- and run only by outbox_relay/store/.
--
-- {table} and friends are identifiers filled in with psycopg.sql.Identifier;
-- %(name)s are bound parameters. Queries that depend on time take %(now)s:
-- NULL in production (the database clock decides), a fixed timestamp in tests
-- that move time without sleeping.

-- name: insert
-- One new message, inside the caller's transaction. A repeated operation key
-- inserts nothing; the caller then compares contents (insert_conflict).
-- A keyed row stores a SHA-256 of its content (migration 0004), so that the
-- comparison never reads another message's payload: a producer role needs
-- no SELECT on payload. The same expression is in insert_conflict and in the
-- backfill of migration 0006; keep the three alike. The trace headers
-- (the trace_keys parameter: traceparent, tracestate, baggage, which enqueue records
-- from the current span) are left out: the same operation retried under
-- another trace is still the same operation.
INSERT INTO {table} AS o
       (aggregate_type, aggregate_id, event_type, payload, headers, operation_key, ordered,
        available_at, waiting_since, content_hash)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s::jsonb,
        %(headers)s::jsonb, %(operation_key)s, %(ordered)s,
        coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval,
        coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval,
        CASE WHEN %(operation_key)s::text IS NOT NULL
             THEN sha256(convert_to(jsonb_build_array(
                      %(aggregate_type)s::text, %(aggregate_id)s::text, %(event_type)s::text,
                      %(payload)s::jsonb, %(headers)s::jsonb - %(trace_keys)s::text[])::text,
                      'UTF8')) END)
ON CONFLICT (operation_key) WHERE operation_key IS NOT NULL DO NOTHING
RETURNING id;

-- name: insert_many
-- insert for several messages in one statement (enqueue_many): one round
-- trip instead of one per message, which was most of a batch producer's
-- cost (230 us of CPU per message in transactions of 8). Each parameter is
-- an array with one element per message, in the caller's order; ids come
-- from the sequence in that order (ORDER BY n), so the returned ids sorted
-- are the inserted rows in order. A keyed row that was not inserted (its key
-- exists, or an earlier row of this batch has it) is compared as in insert;
-- the digest expression is insert's. The text arrays are sent in binary
-- (%(name)b): in text, psycopg escapes every quote and backslash of every
-- element in Python, and a JSON payload is mostly quotes: enqueue_many of
-- 50,000 small messages took 8.4 s (2.2 s in binary), of 20 payloads of
-- 790 kB 3.4 s (0.7 s).
INSERT INTO {table} AS o
       (aggregate_type, aggregate_id, event_type, payload, headers, operation_key, ordered,
        available_at, waiting_since, content_hash)
SELECT r.aggregate_type, r.aggregate_id, r.event_type, r.payload::jsonb, r.headers::jsonb,
       r.operation_key, r.ordered, coalesce(%(now)s::timestamptz, now()) + r.delay,
       coalesce(%(now)s::timestamptz, now()) + r.delay,
       CASE WHEN r.operation_key IS NOT NULL
            THEN sha256(convert_to(jsonb_build_array(
                     r.aggregate_type, r.aggregate_id, r.event_type,
                     r.payload::jsonb, r.headers::jsonb - %(trace_keys)s::text[])::text,
                     'UTF8')) END
  FROM unnest(%(aggregate_types)b::text[], %(aggregate_ids)b::text[], %(event_types)b::text[],
              %(payloads)b::text[], %(headers)b::text[], %(operation_keys)b::text[],
              %(ordered)s::boolean[], %(delays)s::interval[])
       WITH ORDINALITY
       AS r(aggregate_type, aggregate_id, event_type, payload, headers, operation_key, ordered,
            delay, n)
 ORDER BY r.n
ON CONFLICT (operation_key) WHERE operation_key IS NOT NULL DO NOTHING
RETURNING id, operation_key;

-- name: insert_conflict
-- The message that already holds an operation key, and whether it means the
-- same thing: the same digest of aggregate, event type, payload and headers
-- (see insert; trace headers left out). Only id, operation_key and
-- content_hash are read.
SELECT id,
       content_hash = sha256(convert_to(jsonb_build_array(
           %(aggregate_type)s::text, %(aggregate_id)s::text, %(event_type)s::text,
           %(payload)s::jsonb, %(headers)s::jsonb - %(trace_keys)s::text[])::text, 'UTF8')) AS same
  FROM {table}
 WHERE operation_key = %(operation_key)s;

-- name: insert_conflict_full
-- insert_conflict for a keyed row without a digest: one written by a producer
-- of a version before migration 0004 while this one was already migrated (a
-- rolling upgrade). Compares the content itself, which needs SELECT on
-- payload and headers: a least-privilege producer role cannot run it.
SELECT id,
       (aggregate_type = %(aggregate_type)s AND aggregate_id = %(aggregate_id)s
        AND event_type = %(event_type)s AND payload = %(payload)s::jsonb
        AND headers - %(trace_keys)s::text[] = %(headers)s::jsonb - %(trace_keys)s::text[]) AS same
  FROM {table}
 WHERE operation_key = %(operation_key)s;

-- name: advisory_lock
-- A transaction-scoped lock on a text key. Serializes migrations; producers
-- of one ordered aggregate (so that id order equals commit order within the
-- aggregate); and, as claim_lock, the claims of one table when an in-flight
-- cap applies (so that the live-lease count a claim reads cannot be raced
-- past by another).
SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0));

-- name: advisory_locks
-- advisory_lock for many keys in one round trip (a producer's batch of
-- ordered aggregates: one statement per aggregate made a bulk import of
-- 3,000 of them twice as slow as unordered). Taken in the keys' byte order,
-- the order of Python's sorted(), so that producers of this version and of
-- one that locked key by key never wait on each other in a cycle.
SELECT count(pg_advisory_xact_lock(hashtextextended(k, 0)))
  FROM (SELECT k FROM unnest(%(keys)s::text[]) AS k ORDER BY k COLLATE "C") AS sorted;

-- name: claim_lock
-- advisory_lock for a claim under the in-flight cap, and the claim's commit
-- made durable (durable_commit) in the same round trip.
SELECT set_config('synchronous_commit', 'on', true),
       pg_advisory_xact_lock(hashtextextended(%(key)s, 0));

-- name: try_claim_lock
-- claim_lock if the lock is free now: true when taken, false when another
-- transaction holds it (a claim hint then leaves the rows to the claim in
-- progress instead of queueing behind it).
SELECT set_config('synchronous_commit', 'on', true),
       pg_try_advisory_xact_lock(hashtextextended(%(key)s, 0));

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

-- name: begin_caller_transaction
-- A no-op statement that makes psycopg open the caller's transaction (see
-- producer.enqueue_many): {table} is not involved.
SELECT 1;

-- name: async_commit_session
-- A worker connection whose finalizes do not wait for the WAL flush
-- (Settings.synchronous_finalize = false); claims set it back for their own
-- transaction (durable_commit, or claim_lock under the in-flight cap).
SET synchronous_commit = off;

-- name: relay_session
-- A relay connection's session settings (SET takes no bind parameters;
-- set_config does).
--
-- Its server-side bounds: every statement, and every wait for the client
-- inside a transaction. The second frees what a client that vanished
-- mid-transaction holds (found by the fault suite: a relay host cut off the
-- network inside a claim kept the claim's advisory lock, and every other
-- host's claim timed out behind it, until the server's TCP keepalive after
-- hours). The relay never waits on anything but the database inside a
-- transaction, so a healthy relay never reaches it.
--
-- And no JIT compilation. The planner prices the claim's per-aggregate
-- ordering probe high once the table holds a few thousand rows, past
-- jit_above_cost (PostgreSQL's default: JIT on); each claim then spent half a
-- second compiling itself (seen in the durable-task benchmark: 560 ms of
-- 569 ms, docs/benchmarks-changes.md item 5). The relay's statements are short index
-- probes that JIT can only slow down.
--
-- And no bitmap scans, for the same reason. A leased row that finished
-- leaves a dead entry in the leased-rows index until VACUUM (autovacuum
-- comes by once a minute at most), and a bitmap scan visits the heap page
-- of every one of them each time: under a steady 5,000 rows a second the
-- in-flight count behind every claim walked 50,000 dead entries over 2,000
-- heap pages, 10 ms on average and up to 85 ms, half of it under the
-- claim's lock. A plain index scan marks the dead entries it meets (the
-- btree's kill bits) and every later scan steps over them: 0.1 ms, a
-- hundred pages.
SELECT set_config('statement_timeout', %(value)s, false),
       set_config('idle_in_transaction_session_timeout', %(value)s, false),
       set_config('jit', 'off', false),
       set_config('enable_bitmapscan', 'off', false);

-- name: durable_commit
-- A claim bumps the fencing token; its commit must be durable even on a
-- connection that finalizes with synchronous_commit = off (see Settings.
-- synchronous_finalize): a claim forgotten in a crash could hand out the
-- same lease_version twice.
SET LOCAL synchronous_commit = on;

-- name: rescue
-- The rescuer: expired leases go back to 'pending' (due at once) for the claim to
-- hand out again, or to 'dead' when their last attempt began and never
-- finished (a poison message that kills or hangs its worker never reaches an
-- except branch). It needs no room under the in-flight cap and runs on its
-- own tick, so lost delivery tasks can never freeze the relay. It walks the
-- leased index only.
WITH expired AS (
    SELECT id, {frag_max_attempts} AS max_attempts
      FROM {table} AS o
     WHERE status = 'processing'
       AND lease_until < coalesce(%(now)s::timestamptz, now())
     ORDER BY lease_until
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
   SET status       = CASE WHEN o.attempts >= expired.max_attempts THEN 'dead' ELSE 'pending' END,
       -- Keep its place in the queue: it was due before the rows behind it.
       available_at = least(o.available_at, coalesce(%(now)s::timestamptz, now())),
       last_error   = CASE WHEN o.attempts >= expired.max_attempts
                           THEN 'lease expired on the last attempt (' || o.attempts || ' of '
                                || expired.max_attempts || '); the worker crashed or hung'
                           -- A first lease whose delivery never began: its task
                           -- never ran (lost or expired in the broker, or no
                           -- worker registers it: nothing counts an attempt,
                           -- so say which it was not).
                           WHEN o.began_version IS DISTINCT FROM o.lease_version
                           THEN coalesce(o.last_error, 'lease expired before its delivery task '
                                || 'began: lost or expired in the broker, or no worker that '
                                || 'consumes its queue registers it')
                           ELSE coalesce(o.last_error, 'lease expired before delivery finished')
                      END,
       lease_owner  = NULL,
       lease_until  = NULL
  FROM expired
 WHERE o.id = expired.id
RETURNING o.id, o.status;

-- name: frag_max_attempts
-- A row's attempt limit: a durable Celery task's row carries its own (its
-- max_retries + 1, written by its producer); every other row has the relay's
-- %(max_attempts)s. For a row o (rescue, claim, claim_parking).
CASE WHEN o.event_type = 'celery.durable' AND o.headers ? 'max_attempts'
     THEN (o.headers->>'max_attempts')::int ELSE %(max_attempts)s::int END

-- name: frag_waits_behind
-- An ordered row o waits while an earlier ordered row of its aggregate is
-- unfinished ('dead' counts: a dead head blocks its aggregate until a person
-- acts). One probe of the unfinished-rows index.
EXISTS (SELECT 1
          FROM {table} AS prev
         WHERE prev.aggregate_type = o.aggregate_type
           AND prev.aggregate_id = o.aggregate_id
           AND prev.id < o.id
           AND prev.status IN ('pending', 'processing', 'dead')
           AND (prev.ordered OR %(all_ordered)s
                OR prev.event_type = ANY(%(ordered_types)s::text[])))

-- name: frag_follows_young
-- A durable Celery task's row o that its task's runs would take as they end
-- (done_and_take_durable, "following"), due for less than %(hold)s: its
-- producer marked it (headers "follows": the task follows, the call has its
-- plain send options) and its last delivery was not interrupted.
-- %(follow_queue)s NULL: none is (a relay with no durable tasks).
(%(follow_queue)s::int IS NOT NULL
 AND o.event_type = 'celery.durable'
 AND o.headers ? 'follows'
 AND o.available_at > coalesce(%(now)s::timestamptz, now()) - %(hold)s::interval
 AND o.began_version IS DISTINCT FROM o.lease_version)

-- name: frag_young_walk
-- The rows a claim may have left for following runs are among these: the
-- first 256 pending rows due within %(hold)s, in the claim's order, as a
-- row source "o" with what frag_follows_young reads. Bounded, so that a
-- backlog of other rows costs frag_held's pick and next_due's look no more;
-- empty (one-time filter) with %(follow_queue)s NULL.
(SELECT o.id, o.event_type, o.headers, o.available_at, o.began_version, o.lease_version
   FROM {table} AS o
  WHERE %(follow_queue)s::int IS NOT NULL
    AND o.status = 'pending'
    AND o.available_at <= coalesce(%(now)s::timestamptz, now())
    AND o.available_at > coalesce(%(now)s::timestamptz, now()) - %(hold)s::interval
  ORDER BY o.available_at, o.id
  LIMIT 256) AS o

-- name: frag_held
-- A row o a claim leaves in the table for its task's runs to take: one of
-- frag_follows_young beyond the first few, as many as keep
-- %(follow_queue)s such messages sent and not yet begun (leased, began_version
-- behind: in the broker or a worker's prefetch). Without it a backlog within
-- the in-flight cap went out whole by message (one send, hand-over and
-- begin a row: 0.58x the plain UPDATE task) and no run found a row to take.
-- The queue bounds what is held to what the workers cannot start yet; the
-- age (%(hold)s) bounds the rest: messages the broker lost, a worker that
-- does not follow. The few sent are the first of frag_young_walk, picked
-- once per claim (an InitPlan, run only when the claim meets such a row;
-- the count walks the leased index).
({frag_follows_young}
 AND NOT o.id = ANY(ARRAY(
       SELECT o.id
         FROM {frag_young_walk}
        WHERE {frag_follows_young}
        ORDER BY o.available_at, o.id
        LIMIT greatest(0, %(follow_queue)s::int - (
                SELECT count(*)
                  FROM {table} AS q
                 WHERE q.status = 'processing'
                   AND q.lease_until >= coalesce(%(now)s::timestamptz, now())
                   AND q.event_type = 'celery.durable'
                   AND q.headers ? 'follows'
                   AND q.began_version IS DISTINCT FROM q.lease_version)))))

-- name: frag_parked
-- Parked rows (see claim_parking): an ordered row found waiting behind an
-- unfinished one of its aggregate is set aside, its available_at moved 3,000
-- years past the time it was parked, out of the range every claim walks (it
-- was walked and probed again by every claim: one aggregate with 20,000 rows
-- queued made each claim of the table take 265 ms). The band is far from any
-- real due time (a message's delay is at most 100 years, producer.MAX_DELAY;
-- a retry's at most max_defer), so "parked" needs no column
-- of its own and no migration, and the time it was parked stays readable for
-- the rescuer's second look (reprobe_parked).
o.available_at > coalesce(%(now)s::timestamptz, now()) + interval '1000 years'

-- name: frag_park
-- The available_at of a row parked now.
coalesce(%(now)s::timestamptz, now()) + interval '3000 years'

-- name: frag_unpark
-- The available_at of a row made due again: when it began waiting (its due
-- time as written), so that it keeps its place in the queue. A parked row
-- was due when it was parked, so this is never later than now.
least(coalesce(o.waiting_since, o.created_at), coalesce(%(now)s::timestamptz, now()))

-- name: frag_heads
-- The next message of the aggregates of the ordered rows %(ids)s: each
-- aggregate's first unfinished row marked ordered, one probe of the
-- aggregate index each, as a row source "o" (id, status, available_at,
-- event_type, began_version, lease_version) for promote and take_next to
-- filter. They write the rows they pick by primary key (= ANY of an array,
-- worked out first, and "NOT IN" rather than "= 'pending'", which matches the
-- ready index): joined to the table, the planner walked every parked (or
-- due) row of the ready index for them, 5 ms a done with 1,000 parked.
(SELECT DISTINCT f.aggregate_type, f.aggregate_id
   FROM {table} AS f
  WHERE f.id = ANY(%(ids)b::bigint[])
    AND f.ordered) AS a
CROSS JOIN LATERAL (
      SELECT n.id, n.status, n.available_at, n.event_type, n.began_version, n.lease_version
        FROM {table} AS n
       WHERE n.aggregate_type = a.aggregate_type
         AND n.aggregate_id = a.aggregate_id
         AND n.status IN ('pending', 'processing', 'dead')
         AND n.ordered
       ORDER BY n.id
       LIMIT 1) AS o

-- name: frag_exhausted_error
-- The last_error of a row a claim finds out of attempts (it goes dead
-- instead of being leased), else its last_error as it was; for a row o of
-- the CTE "ready" (id, max_attempts): frag_claim_lease's and take_next's.
CASE WHEN o.attempts >= ready.max_attempts
     THEN left('retries exhausted: ' || o.attempts || ' attempts used of '
          || ready.max_attempts || coalesce('; last: ' || o.last_error, ''), 2000)
     ELSE o.last_error END

-- name: frag_row_lease
-- The lease a row o is given (claim and take alike): a durable Celery task's
-- row carries its own (queue wait + body time, the task's
-- outbox_lease_seconds, written by its producer in headers); every other
-- row gets the relay's %(lease)s.
CASE WHEN o.event_type = 'celery.durable' AND o.headers ? 'lease_seconds'
     THEN make_interval(secs => (o.headers->>'lease_seconds')::float8)
     ELSE %(lease)s::interval END

-- name: frag_claim_lease
-- The lease a claim writes on each row of its CTE "ready" (id, max_attempts):
-- the body of claim's and claim_parking's CTE "changed".
UPDATE {table} AS o
   SET status        = CASE WHEN o.attempts >= ready.max_attempts THEN 'dead'
                            ELSE 'processing' END,
       lease_owner   = CASE WHEN o.attempts >= ready.max_attempts THEN NULL
                            ELSE %(owner)s END,
       lease_until   = CASE WHEN o.attempts >= ready.max_attempts THEN NULL
                            ELSE coalesce(%(now)s::timestamptz, now()) + {frag_row_lease}
                       END,
       lease_version = o.lease_version + 1,
       attempts      = CASE WHEN o.attempts >= ready.max_attempts THEN o.attempts
                            ELSE o.attempts + %(count_attempt)s END,
       last_error    = {frag_exhausted_error}
  FROM ready
 WHERE o.id = ready.id
 RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
       o.event_type, o.payload, o.headers, o.operation_key, o.created_at, o.lease_until,
       o.ordered, o.status,
       %(content)s OR o.event_type = 'celery.durable' AS whole,
       -- Its last lease began a delivery that never ended: only the
       -- rescuer gives such a row back (a finalize clears began_version).
       coalesce(o.began_version = o.lease_version - 1, false) AS interrupted,
       -- The payload's stored size (compressed, as on disk; read from its
       -- header, never decompressed): the fan-out keeps a chunk's payloads
       -- within a budget (fanout.CHUNK_PAYLOAD_BYTES).
       pg_column_size(o.payload) AS stored_bytes

-- name: frag_claim_rows
-- What a claim returns of its CTE "changed": the leased rows.
SELECT id, lease_version, attempts, aggregate_type, aggregate_id, event_type,
       CASE WHEN whole THEN payload END,
       CASE WHEN whole THEN headers END,
       operation_key,
       CASE WHEN whole THEN created_at END,
       CASE WHEN whole THEN lease_until END,
       ordered, interrupted, stored_bytes
  FROM changed
 WHERE status = 'processing'

-- name: claim
-- Lease up to %(batch)s due pending rows (store.claim_batch makes it no more
-- than the in-flight cap leaves). Expired leases are not taken here: the
-- rescuer turns them back into pending rows first.
--
-- An ordered row (marked by its producer, or of an event type in
-- %(ordered_types)s, or every row when %(all_ordered)s) is claimable only
-- when no earlier ordered row of its aggregate is unfinished; 'dead' counts
-- as unfinished, so a dead head blocks its aggregate until a person acts.
--
-- %(count_attempt)s is 1 when the claim starts the attempt (the plain loop
-- publishes at once) and 0 when the delivery task counts it as it begins
-- (Celery: a fan-out task that expired in the broker unrun costs nothing).
-- A row that has already used every attempt (max_attempts was lowered)
-- goes to 'dead' instead of starting one more; only leased rows are returned.
--
-- %(content)s false: each row comes back without its payload, headers,
-- created_at and lease_until (NULL), except a durable Celery task's row,
-- which the fan-out sends as the task itself. The delivery task reads them
-- when it begins; decoding every claimed row's JSON here as well was a sixth
-- of a chunked relay's pool time, and its two timestamps cost the claim's
-- client more than all its other columns (1.4 us each here).
WITH ready AS (
    SELECT o.id, {frag_max_attempts} AS max_attempts
      FROM {table} AS o
     WHERE o.status = 'pending'
       AND o.available_at <= coalesce(%(now)s::timestamptz, now())
       AND (NOT (o.ordered OR %(all_ordered)s OR o.event_type = ANY(%(ordered_types)s::text[]))
            OR NOT {frag_waits_behind})
       AND NOT {frag_held}
     ORDER BY o.available_at, o.id
     -- Under the in-flight cap, store.claim_batch has already counted the
     -- live leases (in_flight, under the claim's lock) into %(batch)s.
     LIMIT %(batch)s::int
       FOR UPDATE SKIP LOCKED
), changed AS ({frag_claim_lease})
{frag_claim_rows};

-- name: claim_parking
-- claim, for a claim under the in-flight cap's lock (claim_lock) that also
-- parks what it walks past: a row marked ordered that waits behind an
-- unfinished row of its aggregate (frag_waits_behind) is locked and parked
-- (frag_parked) instead of being skipped, so that the next claims no longer
-- walk and probe it. The rows walked are at most %(batch)s, leased and parked
-- together: a claim that parked rows comes back short and the caller counts
-- the parked ones as taken (more may be due).
--
-- A parked row is made due again by the write that finishes the row before
-- it (promote, under the same lock: a claim that saw that row unfinished has
-- committed its parking by then, or the finished row is visible to it, so no
-- row is parked behind a row already finished); the rescuer looks at rows
-- parked for long (reprobe_parked) in case any other writer finished it.
-- Only the producer's mark counts here (ordered types and "every row" are
-- the plain loop's, whose claims park nothing): promote looks for it alone.
--
-- Parked rows come back as rows whose lease_version is NULL.
WITH walked AS (
    SELECT o.id, {frag_max_attempts} AS max_attempts,
           CASE WHEN o.ordered THEN {frag_waits_behind} ELSE false END AS blocked
      FROM {table} AS o
     WHERE o.status = 'pending'
       AND o.available_at <= coalesce(%(now)s::timestamptz, now())
       AND NOT {frag_held}
     ORDER BY o.available_at, o.id
     LIMIT %(batch)s::int
       FOR UPDATE SKIP LOCKED
), parked AS (
    UPDATE {table} AS o
       SET available_at = {frag_park}
      FROM walked
     WHERE o.id = walked.id
       AND walked.blocked
    RETURNING o.id
), ready AS (
    SELECT id, max_attempts FROM walked WHERE NOT blocked
), changed AS ({frag_claim_lease})
{frag_claim_rows}
UNION ALL
SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
  FROM parked;

-- name: begin
-- A delivery task begins: the rows of its chunk still held under the given
-- versions, with the lease left and the message's age. A row with at least
-- %(needed)s of lease left is started (its attempt counted when
-- %(count_attempt)s = 1, once per lease version: a duplicated task begins
-- again but counts nothing, see migration 0005); one with less is returned unstarted, for the task
-- to give back at once rather than publish into a lease that may end midway.
-- A missing row means "not mine any more". (lease_until, not status: see
-- finalize.) Empty headers come back as NULL: most rows have none, and
-- decoding an empty object per row was a twentieth of a chunk's pool time.
-- %(chain_only)s: of the payload only {"chain": ...}, for a durable task's
-- run, whose arguments come with its Celery message (not the whole row's
-- JSON to send and decode per run).
UPDATE {table} AS o
   SET attempts = o.attempts + CASE
           WHEN o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval
            AND o.began_version IS DISTINCT FROM o.lease_version
           THEN %(count_attempt)s ELSE 0 END,
       began_version = CASE
           WHEN o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval
           THEN o.lease_version ELSE o.began_version END
  FROM unnest(%(ids)b::bigint[], %(versions)b::bigint[]) AS v(id, version)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
          o.event_type,
          CASE WHEN %(chain_only)s THEN jsonb_build_object('chain', o.payload->'chain')
               ELSE o.payload END,
          nullif(o.headers, jsonb_build_object()), o.operation_key,
          o.created_at, o.lease_until, o.ordered,
          extract(epoch FROM o.lease_until - coalesce(%(now)s::timestamptz, now()))::float8,
          extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - o.created_at)::float8,
          o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval;

-- name: begin_one
-- begin for one message (the per-message deliver task): plain parameters
-- plan far cheaper than unnest() of one-element arrays.
UPDATE {table} AS o
   SET attempts = o.attempts + CASE
           WHEN o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval
            AND o.began_version IS DISTINCT FROM o.lease_version
           THEN %(count_attempt)s ELSE 0 END,
       began_version = CASE
           WHEN o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval
           THEN o.lease_version ELSE o.began_version END
 WHERE o.id = %(id)s
   AND o.lease_version = %(version)s
   AND o.lease_until IS NOT NULL
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_type, o.aggregate_id,
          o.event_type,
          CASE WHEN %(chain_only)s THEN jsonb_build_object('chain', o.payload->'chain')
               ELSE o.payload END,
          nullif(o.headers, jsonb_build_object()), o.operation_key,
          o.created_at, o.lease_until, o.ordered,
          extract(epoch FROM o.lease_until - coalesce(%(now)s::timestamptz, now()))::float8,
          extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - o.created_at)::float8,
          o.lease_until - coalesce(%(now)s::timestamptz, now()) >= %(needed)s::interval;

-- name: finalize
-- Fenced finalize of many messages in one statement. Its arrays, as those of
-- begin, finalize_done, done_under and extend_lease, go in binary (%(name)b):
-- psycopg builds a text array in Python, 54 us for 50 ids against 17 in
-- binary, and 257 us against 13 for 50 error texts (each one escaped).
-- A row changes only when it is still held (lease_until IS NOT NULL, which
-- the table's CHECK makes equivalent to status = 'processing') under the
-- caller's lease_version.
-- We test lease_until rather than status on purpose: "status = 'processing'"
-- implies the predicates of the leased and unfinished partial indexes, and
-- with thin statistics the planner may then scan one of those whole indexes
-- instead of probing the primary key (tests/test_plans.py guards this).
-- An outcome marked unless_begun (a row given back unpublished by someone
-- other than the delivery that began it: fan-out's failure path, a
-- duplicated task that found too little lease) leaves a row whose delivery
-- began under this lease version to that delivery, so a release never ends
-- a lease in the middle of its publish (docs/model.md, finding 2).
UPDATE {table} AS o
   SET status       = v.status,
       available_at = CASE WHEN v.status = 'pending'
                           THEN coalesce(%(now)s::timestamptz, now()) + v.delay
                           ELSE o.available_at END,
       attempts     = greatest(0, o.attempts - v.refund),
       last_error   = v.error,
       done_at      = CASE WHEN v.status = 'done'
                           THEN coalesce(%(now)s::timestamptz, now()) END,
       -- The delivery ended with an outcome: the next claim must not take
       -- the row for one that died under it (claim's "interrupted").
       began_version = CASE WHEN v.status = 'done' THEN o.began_version END,
       lease_owner  = NULL,
       lease_until  = NULL
  FROM unnest(%(ids)b::bigint[], %(versions)b::bigint[], %(statuses)b::text[],
              %(delays)b::interval[], %(refunds)b::int[], %(errors)b::text[],
              %(unless_begun)b::bool[])
       AS v(id, version, status, delay, refund, error, unless_begun)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL
   AND NOT (v.unless_begun AND o.began_version IS NOT DISTINCT FROM o.lease_version)
RETURNING o.id, o.ordered AND o.status = 'done';

-- name: finalize_done
-- finalize for a chunk whose every row was published (the usual case): what
-- finalize writes for a plain done, from two arrays instead of seven (a
-- seventh of the parameters to encode and unnest). The same fence.
UPDATE {table} AS o
   SET status      = 'done',
       last_error  = NULL,
       done_at     = coalesce(%(now)s::timestamptz, now()),
       lease_owner = NULL,
       lease_until = NULL
  FROM unnest(%(ids)b::bigint[], %(versions)b::bigint[]) AS v(id, version)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until IS NOT NULL
RETURNING o.id, o.ordered AND o.status = 'done';

-- name: done_under
-- Which of these rows are done under the very lease version given: after a
-- write whose answer was lost (a connection cut after its COMMIT), the
-- completer's second write changes nothing, and this tells "done by our
-- first write" from "re-claimed and finished by another worker" (a newer
-- version). Read only; by primary key.
SELECT o.id
  FROM {table} AS o
  JOIN unnest(%(ids)b::bigint[], %(versions)b::bigint[]) AS v(id, version)
    ON o.id = v.id AND o.lease_version = v.version
 WHERE o.status = 'done';

-- name: frag_finalize_one
-- finalize for one message, with plain parameters (see begin_one).
-- The same fence: id, lease_version, a live lease, and unless_begun.
-- The body of finalize_one and of done_and_take_durable's CTE "done".
UPDATE {table} AS o
   SET status       = %(status)s,
       available_at = CASE WHEN %(status)s = 'pending'
                           THEN coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval
                           ELSE o.available_at END,
       attempts     = greatest(0, o.attempts - %(refund)s),
       last_error   = %(error)s,
       done_at      = CASE WHEN %(status)s = 'done'
                           THEN coalesce(%(now)s::timestamptz, now()) END,
       began_version = CASE WHEN %(status)s = 'done' THEN o.began_version END,
       lease_owner  = NULL,
       lease_until  = NULL
 WHERE o.id = %(id)s
   AND o.lease_version = %(version)s
   AND o.lease_until IS NOT NULL
   AND NOT (%(unless_begun)s AND o.began_version IS NOT DISTINCT FROM o.lease_version)
RETURNING o.id, o.ordered AND o.status = 'done'

-- name: finalize_one
-- frag_finalize_one, on its own.
{frag_finalize_one};

-- name: promote
-- Make due again the parked successors of these rows, which just finished
-- (done, in this transaction or before): for each of their aggregates, the
-- first unfinished row marked ordered (frag_heads), if it is parked
-- (frag_parked). Run under the claim's lock (claim_lock's key,
-- advisory_lock), after the claim in progress, if any, has committed what it
-- parked (see claim_parking). Making due a row that still waits is
-- harmless: the next claim parks it again.
UPDATE {table} AS o
   SET available_at = {frag_unpark}
 WHERE o.id = ANY(ARRAY(SELECT o.id
                          FROM {frag_heads}
                         WHERE o.status = 'pending'
                           AND {frag_parked}))
   AND o.status NOT IN ('processing', 'done', 'dead')
RETURNING o.id;

-- name: frag_live_leases
-- Live leases, the backpressure measure (walks the leased index only):
-- in_flight's, and counted inside take_chunk. Expired leases do not count:
-- they hold nothing, and the rescuer frees them.
SELECT count(*)
  FROM {table}
 WHERE status = 'processing'
   AND lease_until >= coalesce(%(now)s::timestamptz, now())

-- name: frag_take_lease
-- A lease and a begin in one, on each row of the CTE "ready" (id,
-- max_attempts), for a delivery task that publishes the rows at once (no
-- broker in between to lose them): the lease as a claim writes it, the
-- attempt counted and the delivery marked begun as begin does; a row out of
-- attempts goes dead, as a claim would send it. The body of take_next's and
-- take_chunk's CTE "changed".
UPDATE {table} AS o
   SET status        = CASE WHEN o.attempts >= ready.max_attempts THEN 'dead'
                            ELSE 'processing' END,
       lease_owner   = CASE WHEN o.attempts >= ready.max_attempts THEN NULL
                            ELSE %(owner)s END,
       lease_until   = CASE WHEN o.attempts >= ready.max_attempts THEN NULL
                            ELSE coalesce(%(now)s::timestamptz, now()) + {frag_row_lease}
                       END,
       -- A parked row taken as it is leaves the parked band (the
       -- time it waited from, as promote would have made it due).
       available_at  = CASE WHEN {frag_parked} THEN {frag_unpark}
                            ELSE o.available_at END,
       lease_version = o.lease_version + 1,
       attempts      = CASE WHEN o.attempts >= ready.max_attempts THEN o.attempts
                            ELSE o.attempts + 1 END,
       began_version = CASE WHEN o.attempts >= ready.max_attempts THEN o.began_version
                            ELSE o.lease_version + 1 END,
       last_error    = {frag_exhausted_error}
  FROM ready
 WHERE o.id = ready.id
RETURNING o.*

-- name: frag_take_rows
-- What take_next and take_chunk return of their CTE "changed": begin's
-- columns, for the rows leased (not those sent dead).
SELECT id, lease_version, attempts, aggregate_type, aggregate_id, event_type, payload,
       nullif(headers, jsonb_build_object()), operation_key, created_at, lease_until, ordered,
       extract(epoch FROM lease_until - coalesce(%(now)s::timestamptz, now()))::float8,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - created_at)::float8,
       true
  FROM changed
 WHERE status = 'processing'

-- name: take_next
-- Lease and begin, for the delivery task that just finished them, the next
-- message of the aggregates of these ordered rows (done in this transaction
-- or before): each aggregate's first unfinished row marked ordered, if it is
-- pending and due, or parked (taken as it is, its available_at made what
-- promote would have made it: store.finalize_and_take then needs no promote
-- for it). A claim and a
-- begin in one: under the claim's lock (claim_lock), at most %(batch)s rows
-- (store.take_next counts the live leases into it, as claim_batch does), one
-- per aggregate; the attempt counted and the delivery marked begun, as begin
-- does, because the task publishes it at once (no broker in between to lose
-- it). Returns begin's columns. The task delivers them at once
-- (celery/tasks.py, _Follow): without this, each message of an aggregate
-- waited for a claim task and a delivery task to cross the broker, about
-- 25 ms, 40 a second for one aggregate.
--
-- Left to the claim, which handles them already: a durable Celery task's
-- row (the fan-out sends it as the task itself), and a row whose last
-- delivery was interrupted (its process died under it: the fan-out delivers
-- it alone). A row locked by a claim in progress is the claim's (SKIP
-- LOCKED). A row out of attempts goes dead, as a claim would send it, and
-- is not returned.
--
-- Whatever the ids given, only a head is ever taken (the row a claim could
-- take), so the statement does not check that they are done: "status =
-- 'done'" let the planner walk the whole done index for them.
WITH heads AS (
    SELECT o.id
      FROM {frag_heads}
     WHERE o.status = 'pending'
       AND (o.available_at <= coalesce(%(now)s::timestamptz, now()) OR {frag_parked})
       AND o.event_type <> 'celery.durable'
       AND o.began_version IS DISTINCT FROM o.lease_version
), ready AS (
    SELECT o.id, {frag_max_attempts} AS max_attempts
      FROM {table} AS o
     WHERE o.id = ANY(ARRAY(SELECT id FROM heads))
       -- Pending, checked again on the row locked (see frag_heads).
       AND o.status NOT IN ('processing', 'done', 'dead')
     ORDER BY o.id
     LIMIT %(batch)s::int
       FOR UPDATE OF o SKIP LOCKED
), changed AS ({frag_take_lease})
{frag_take_rows};

-- name: take_chunk
-- Lease and begin up to %(batch)s due rows for the delivery task that runs
-- this, to publish beside the chunk it is publishing (Deliverer._pipeline:
-- a publisher that waits). A claim and a begin in one, under the claim's
-- lock (claim_lock), within the in-flight cap %(cap)s (NULL: none), counted
-- here; and within %(budget)s bytes of stored payload, as the fan-out's
-- chunks are (fanout.CHUNK_PAYLOAD_BYTES; one row at least).
--
-- Only plain rows: the rows a claim would lease next (the first %(walk)s due,
-- in its order) less those it handles itself: ordered rows (their
-- aggregate's turn), a durable Celery task's row (sent as the task itself),
-- a row whose last delivery was interrupted (delivered alone). Walked
-- unlocked and bounded, so that a backlog of such rows costs the walk no
-- more; a row a claim in progress holds is the claim's (SKIP LOCKED).
WITH walked AS (
    SELECT o.id, o.available_at, pg_column_size(o.payload) AS stored
      FROM (SELECT *
              FROM {table} AS o
             WHERE o.status = 'pending'
               AND o.available_at <= coalesce(%(now)s::timestamptz, now())
             ORDER BY o.available_at, o.id
             LIMIT %(walk)s::int) AS o
     WHERE NOT o.ordered
       AND o.event_type <> 'celery.durable'
       AND o.began_version IS DISTINCT FROM o.lease_version
), within AS (
    SELECT id, sum(stored) OVER (ORDER BY available_at, id) - stored AS before
      FROM walked
), ready AS (
    SELECT o.id, {frag_max_attempts} AS max_attempts
      FROM {table} AS o
     WHERE o.id = ANY(ARRAY(SELECT id FROM within WHERE before < %(budget)s::bigint))
       -- Pending, checked again on the row locked.
       AND o.status = 'pending'
     ORDER BY o.available_at, o.id
     LIMIT greatest(0, least(%(batch)s::int, %(cap)s::int - ({frag_live_leases})))
       FOR UPDATE OF o SKIP LOCKED
), changed AS ({frag_take_lease})
{frag_take_rows};

-- name: done_and_take_durable
-- The fenced done of a durable Celery task's run (frag_finalize_one, in the
-- transaction of the run's effect) and, if it was still the run's to
-- finish, the lease and begin of the next due row of the same task %(task)s
-- for that run's pool process to run at once (celery/durable_run.py,
-- "following"): a claim, the task's send and its begin in one statement.
-- Done and take commit together, so the live leases never drop and rise
-- between them: no claim's lock and no count of the cap are needed (one
-- lease ends as one begins). One row: whether the done was written (1 or
-- 0), then begin's columns of the row taken (NULL: none).
--
-- Only a row the worker would run as this task's next message: a tracked
-- row of this task (by its aggregate, celery.task/<name>), with the send
-- options of a plain call %(options)s (a per-call queue, priority or time
-- limit: its message would go elsewhere or carry more), not ordered, and
-- not interrupted (delivered alone). Its lease is its own, as a claim gives
-- it (frag_row_lease).
-- Walked unlocked and bounded: of the first 16 due rows in the claim's
-- order, the first such row in id order that no one holds; a backlog of
-- other rows costs the take no more. A row out of attempts goes dead, as a
-- claim would send it, and is not returned.
WITH done AS ({frag_finalize_one}), walked AS (
    SELECT o.id
      FROM (SELECT o.id, o.event_type, o.aggregate_type, o.aggregate_id, o.ordered,
                   o.began_version, o.lease_version, o.headers
              FROM {table} AS o
             WHERE o.status = 'pending'
               AND o.available_at <= coalesce(%(now)s::timestamptz, now())
             ORDER BY o.available_at, o.id
             LIMIT 16) AS o
     WHERE o.event_type = 'celery.durable'
       AND o.aggregate_type = 'celery.task'
       AND o.aggregate_id = %(task)s
       AND NOT o.ordered
       AND o.began_version IS DISTINCT FROM o.lease_version
), ready AS (
    -- In id order, the primary key's: the scan stops at the first row that
    -- passes and is not locked, and the payload (a row's largest column) is
    -- read for the rows it passes over and that one alone.
    SELECT o.id, {frag_max_attempts} AS max_attempts
      FROM {table} AS o
     WHERE o.id = ANY(ARRAY(SELECT id FROM walked))
       -- Pending, checked again on the row locked.
       AND o.status = 'pending'
       AND o.payload->'options' = %(options)s::jsonb
       AND EXISTS (SELECT 1 FROM done)
     ORDER BY o.id
     LIMIT 1
       FOR UPDATE OF o SKIP LOCKED
), changed AS ({frag_take_lease})
SELECT (SELECT count(*) FROM done)::int, taken.*
  FROM (SELECT 1) AS one
  LEFT JOIN ({frag_take_rows}) AS taken ON true;

-- name: reprobe_parked
-- The rescuer's second look at rows parked longer than %(after)s: made due
-- again when nothing unfinished is ahead of them any more (a finish that did
-- not promote them: a worker of an earlier release in a rolling upgrade, a
-- change by hand), parked anew otherwise, to be looked at again %(again)s
-- later (dated that much ahead: a row behind a dead message for hours is
-- rewritten every %(again)s, not every %(after)s). At most %(batch)s a run,
-- the longest parked first; one probe each.
WITH due AS (
    SELECT o.id, {frag_waits_behind} AS blocked
      FROM {table} AS o
     WHERE o.status = 'pending'
       AND {frag_parked}
       AND o.available_at <= coalesce(%(now)s::timestamptz, now()) + interval '3000 years'
                             - %(after)s::interval
     ORDER BY o.available_at, o.id
     LIMIT %(batch)s::int
       FOR UPDATE SKIP LOCKED
)
UPDATE {table} AS o
   SET available_at = CASE WHEN due.blocked
                           THEN {frag_park} + (%(again)s::interval - %(after)s::interval)
                           ELSE {frag_unpark} END
  FROM due
 WHERE o.id = due.id
RETURNING o.id, NOT due.blocked;

-- name: extend_lease
-- Fenced lease renewal (the heartbeat of long chunks), measured by the
-- database's clock: returns each renewed row with the lease it now has left.
-- Only a live lease is renewed: an expired one no longer counts against the
-- in-flight cap (a claim may have used its room) and is the rescuer's to free,
-- so a late heartbeat must not bring it back.
UPDATE {table} AS o
   SET lease_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval
  FROM unnest(%(ids)b::bigint[], %(versions)b::bigint[]) AS v(id, version)
 WHERE o.id = v.id
   AND o.lease_version = v.version
   AND o.lease_until >= coalesce(%(now)s::timestamptz, now())
RETURNING o.id,
          extract(epoch FROM o.lease_until - coalesce(%(now)s::timestamptz, now()))::float8;

-- name: in_flight
-- Live leases, the backpressure measure (frag_live_leases).
{frag_live_leases};

-- name: next_due
-- Seconds until the first pending row that is not due yet falls due (a
-- retry's backoff, a delayed message), or until the first row a claim may
-- have left for its task's runs (frag_follows_young) waits the hold out;
-- NULL when there is none: probes of the ready index, whatever the table
-- holds. The second walks frag_young_walk only (unbounded, it walked a
-- chunked relay's whole backlog at its knee after every short claim); a
-- row left beyond it waits for a run's claim hint or beat's tick instead.
SELECT least(
    (SELECT extract(epoch FROM min(o.available_at) - coalesce(%(now)s::timestamptz, now()))::float8
       FROM {table} AS o
      WHERE o.status = 'pending'
        AND o.available_at > coalesce(%(now)s::timestamptz, now())
        -- Not a parked row (frag_parked), as a range of the index.
        AND o.available_at <= coalesce(%(now)s::timestamptz, now()) + interval '1000 years'),
    (SELECT extract(epoch FROM o.available_at + %(hold)s::interval
                               - coalesce(%(now)s::timestamptz, now()))::float8
       FROM {frag_young_walk}
      WHERE {frag_follows_young}
      ORDER BY o.available_at, o.id
      LIMIT 1));

-- name: listen
-- {channel} is the table's notification channel (OutboxTable.channel).
LISTEN {channel};

-- name: table_exists
-- format('%%I.%%I') quotes both names, so mixed-case names are found as written.
SELECT to_regclass(format('%%I.%%I', %(schema)s::text, %(name)s::text)) IS NOT NULL;

-- name: may_insert
-- Whether this session's role may insert rows: a worker that runs durable
-- tasks writes a chain's next step (the relay's own grant has no INSERT).
SELECT has_table_privilege(format('%%I.%%I', %(schema)s::text, %(name)s::text), 'INSERT');

-- name: relay_lacks
-- What this session's role lacks of what the relay's claims and finalizes
-- do (op_grant_relay's SELECT and UPDATE columns): an operator's role, or
-- grants saved from an earlier release, started and then failed every claim
-- with "permission denied". DELETE is purge's alone and not checked here.
SELECT 'UPDATE (' || c || ')'
  FROM unnest(ARRAY['status', 'available_at', 'waiting_since', 'attempts', 'lease_owner',
                    'lease_until', 'lease_version', 'last_error', 'done_at',
                    'began_version']) AS c
 WHERE NOT has_column_privilege(format('%%I.%%I', %(schema)s::text, %(name)s::text), c, 'UPDATE')
UNION ALL
SELECT 'SELECT'
 WHERE NOT has_table_privilege(format('%%I.%%I', %(schema)s::text, %(name)s::text), 'SELECT');

-- name: session_defaults
-- The settings a session of this role in this database starts with: the
-- server's, the database's and the role's (ALTER ROLE ... SET), never a SET
-- some client of a pooler left in the server session this statement ran in.
-- Through a pooler in transaction mode the relay sets none of its own
-- (Settings.transaction_pooling), and these are what its statements run
-- with (relay_session says why it wants each one).
SELECT name, reset_val
  FROM pg_settings
 WHERE name IN ('statement_timeout', 'idle_in_transaction_session_timeout', 'jit',
                'enable_bitmapscan')
 ORDER BY name;

-- name: relay_identity
-- What tells this relay's Celery tasks from another relay's on one broker
-- queue (celery/identity.py): the database, and when this table's first
-- migration was applied. The same for every DSN that reaches this database
-- (a pooler, another host name for it), different for another table or
-- another database of the same name.
SELECT current_database(), (SELECT applied_at FROM {migrations} WHERE version = 1);

-- name: bound_durable_session
-- The sessions durable task runs hold for a whole run (their own pool, never
-- the relay's): the fence check, the transaction the body writes its effect
-- in (committed with the row's fenced 'done') and that finalize. A relay
-- session ends one idle in a transaction after the database timeout; a body
-- may think for longer than that between statements, but not past the end of
-- its last possible lease (its longest run plus one lease): after that the run
-- is stale, its effect must roll back anyway, and its locks must not block the
-- run that replaced it.
SELECT set_config('idle_in_transaction_session_timeout', %(value)s, false),
       set_config('statement_timeout', %(value)s, false);
