-- The lease version under which a delivery last began.
--
-- A delivery task is a hint the broker may deliver twice; both copies carry
-- the same (id, lease_version) and pass the fence. The attempt is counted
-- by the first begin under a lease only (begin compares this column with
-- lease_version), so duplicated tasks cannot spend a row's attempts early
-- nor push them past max_attempts. Nullable: no table rewrite; NULL means
-- "not begun under the current lease", which is right for every existing row.
ALTER TABLE {table} ADD COLUMN began_version bigint;
