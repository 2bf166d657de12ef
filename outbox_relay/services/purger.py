"""The purger: deletes finished rows past their retention, in bounded batches."""

from __future__ import annotations

from datetime import timedelta

from .. import store
from ..db import Database
from ..table import OutboxTable

__all__ = ["Purger"]


class Purger:
    """Deletes ``done`` rows older than ``older_than``, in bounded batches
    (``run_once``), so that the table stays small."""

    def __init__(
        self,
        db: Database,
        *,
        table: OutboxTable,
        older_than: timedelta,
        batch_size: int = 5000,
        max_batches: int = 100,
    ) -> None:
        self.db = db
        self.table = table
        self.older_than = older_than
        self.batch_size = batch_size
        self.max_batches = max_batches

    def run_once(self) -> store.PurgeResult:
        """Up to ``max_batches`` batches, each its own bounded database call."""
        deleted = batches = 0
        first: store.PurgeResult | None = None
        while batches < self.max_batches:
            result = self.db.run(
                lambda conn: store.purge(
                    conn,
                    older_than=self.older_than,
                    batch_size=self.batch_size,
                    max_batches=1,
                    table=self.table,
                )
            )
            first = first or result
            deleted += result.deleted
            batches += 1
            if result.deleted < self.batch_size:
                break
        assert first is not None  # max_batches >= 1
        return store.PurgeResult(
            deleted=deleted, batches=batches, cutoff=first.cutoff, more_left=result.more_left
        )
