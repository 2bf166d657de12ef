-- The operation-key digest leaves the trace headers out.
--
-- enqueue() now records the current OpenTelemetry trace context in a row's
-- headers (outbox_relay.tracing). A request retried with the same operation
-- key arrives under another trace, so a digest over all headers would call
-- the retry a different message (OperationKeyConflict). The digest of
-- migration 0004 is recomputed without traceparent, tracestate and baggage,
-- the expression the insert and insert_conflict queries now compute
-- (queries.sql; tests/test_security.py checks that they agree). Only keyed
-- rows that carry one of those headers change.
UPDATE {table}
   SET content_hash = sha256(convert_to(jsonb_build_array(
           aggregate_type, aggregate_id, event_type, payload,
           headers - ARRAY['traceparent', 'tracestate', 'baggage'])::text, 'UTF8'))
 WHERE operation_key IS NOT NULL
   AND headers ?| ARRAY['traceparent', 'tracestate', 'baggage'];
