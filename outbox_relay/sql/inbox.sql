-- Queries of the consumer-side inbox, run only by outbox_relay/store/inbox.py
-- (the rules of use are in outbox_relay/inbox/).
--
-- {inbox} is the inbox table and {ix_inbox_received} its retention index,
-- both filled in with psycopg.sql.Identifier. Beside an outbox they are
-- {table}_inbox and {table}_inbox_received; store/inbox.py also renders these
-- queries for an inbox table of the user's choosing.

-- name: inbox_record
-- Runs in the receiver's transaction. No row back means "already recorded":
-- by a committed transaction, or by a concurrent one this statement waited
-- for (then its commit made the conflict; its rollback lets this insert in).
INSERT INTO {inbox} (consumer, message_id, received_at)
VALUES (%(consumer)s, %(message_id)s, coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING true;

-- name: inbox_seen
SELECT EXISTS (
    SELECT 1 FROM {inbox} WHERE consumer = %(consumer)s AND message_id = %(message_id)s
);

-- name: inbox_purge
-- One batch of retention, oldest first along the received_at index; rows
-- another transaction holds are left for the next run.
DELETE FROM {inbox} AS i
 USING (SELECT consumer, message_id
          FROM {inbox}
         WHERE received_at < coalesce(%(now)s::timestamptz, now()) - %(older_than)s::interval
           AND (%(consumer)s::text IS NULL OR consumer = %(consumer)s::text)
         ORDER BY received_at
         LIMIT %(batch)s
           FOR UPDATE SKIP LOCKED) AS old
 WHERE i.consumer = old.consumer
   AND i.message_id = old.message_id;

-- name: inbox_lock
-- Serializes ensure_inbox() runs: concurrent CREATE TABLE IF NOT EXISTS can
-- still fail on the catalog's unique indexes.
SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0));

-- name: inbox_create_schema
-- ensure_inbox() then runs migrations/0002_inbox.sql under the inbox's own names.
CREATE SCHEMA IF NOT EXISTS {schema};

