-- The consumer-side inbox: one row per (consumer, message id) already handled.
--
-- A receiver inserts its row in the same transaction as the effect of the
-- message; a duplicate delivery then conflicts on the primary key and is
-- skipped. A concurrent duplicate waits on the first one's uncommitted row
-- and sees the conflict once it commits, so exactly one effect lands.
--
-- IF NOT EXISTS: outbox_relay.inbox.ensure_inbox() creates the same table in
-- a consumer's database that has no outbox; migrating that database later
-- must not fail on it.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention (purge_inbox) deletes the oldest rows first, in batches.
CREATE INDEX IF NOT EXISTS {ix_inbox_received} ON {inbox} (received_at);
