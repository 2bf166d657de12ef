-- When a message began waiting for its delivery: its due time when written
-- (created_at, or later with a delay, countdown or eta), or when an operator
-- sent it back from dead. The age of the oldest waiting message (`status`,
-- outbox_oldest_pending_age_seconds and the SLO alerts on it) counts from
-- here. Before, a message that had failed counted from created_at, so one
-- scheduled an hour ahead that failed once showed an hour's wait and paged,
-- and a dead message retried by an operator counted its days as dead.
-- Nullable: no table rewrite; existing rows count as before (created_at),
-- and producers of an earlier release go on writing rows without it.
ALTER TABLE {table} ADD COLUMN waiting_since timestamptz;

-- Roles given column privileges (`outbox-relay grant`) on available_at get
-- the same on waiting_since, so that a producer role can still insert and an
-- operator role still read it and retry dead rows, without granting again:
-- who may write or read when a message is due may do so for since when it
-- waits. Table-wide privileges already cover the new column.
DO $grant$
DECLARE
    target regclass := {table_literal}::regclass;
    granted record;
BEGIN
    FOR granted IN
        SELECT DISTINCT p.privilege_type, p.grantee
          FROM pg_attribute AS a, aclexplode(a.attacl) AS p
         WHERE a.attrelid = target AND a.attname = 'available_at'
    LOOP
        EXECUTE format('GRANT %s (waiting_since) ON TABLE %s TO %s',
                       granted.privilege_type, target,
                       CASE WHEN granted.grantee = 0 THEN 'PUBLIC'
                            ELSE granted.grantee::regrole::text END);
    END LOOP;
END
$grant$;
