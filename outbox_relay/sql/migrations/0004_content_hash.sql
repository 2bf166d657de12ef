-- A digest of what a message means, for the operation-key check.
--
-- enqueue() with an operation key that already exists must tell "the same
-- operation again" (return the existing id) from "a different message under
-- the same key" (OperationKeyConflict). It used to compare the stored
-- payload and headers with the new ones, which made every producer role
-- able to read every other message's payload (SELECT on payload). Comparing
-- a SHA-256 of the content instead lets a least-privilege producer be
-- granted SELECT on (id, operation_key, content_hash) only
-- (operations.grants, "producer").
--
-- Only rows with an operation key carry one: nothing else is ever compared.
-- The expression is the one the insert and insert_conflict queries compute
-- from their parameters (queries.sql); tests/test_security.py checks that the
-- three agree. The backfill touches keyed rows only; the column is nullable, so
-- adding it rewrites nothing.
ALTER TABLE {table} ADD COLUMN content_hash bytea;

UPDATE {table}
   SET content_hash = sha256(convert_to(jsonb_build_array(
           aggregate_type, aggregate_id, event_type, payload, headers)::text, 'UTF8'))
 WHERE operation_key IS NOT NULL;
