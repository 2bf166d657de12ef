"""The fault-injection suite: real relay processes under injected faults, each
scenario ending with a ledger check (see harness.py and docs/reliability.md)."""
