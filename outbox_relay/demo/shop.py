"""The demo's shop: orders written with their outbox events, as an application would."""

from __future__ import annotations

import threading

import psycopg

from ..producer import enqueue
from ..store import ops
from ..table import OutboxTable

__all__ = ["ENQUEUE_SECONDS", "OrderWriter"]

# Orders are written over this many seconds, like traffic, not in one burst.
ENQUEUE_SECONDS = 4.0


class OrderWriter(threading.Thread):
    """Writes the orders: each one an order row and its outbox event in one transaction."""

    def __init__(self, dsn: str, table: OutboxTable, count: int, stop: threading.Event) -> None:
        super().__init__(name="demo-orders", daemon=True)
        self.dsn = dsn
        self.table = table
        self.count = count
        self.stop = stop
        self.enqueued = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        pause = ENQUEUE_SECONDS / self.count
        try:
            with psycopg.connect(self.dsn, autocommit=True, application_name="demo-shop") as conn:
                for n in range(self.count):
                    if self.stop.is_set():
                        return
                    customer, total = f"customer-{n % 37}", 1_000 + (n * 7_919) % 50_000
                    # The business transaction: the order and its event commit
                    # together, or neither exists.
                    with conn.transaction():
                        order_id = ops.insert_demo_order(
                            conn, customer=customer, total_cents=total, table=self.table
                        )
                        enqueue(
                            conn,
                            aggregate_type="order",
                            aggregate_id=order_id,
                            event_type="order.created",
                            payload={
                                "order_id": order_id,
                                "customer": customer,
                                "total_cents": total,
                                "currency": "EUR",
                            },
                            table=self.table,
                            ordered=False,
                            notify=True,
                        )
                    self.enqueued += 1
                    self.stop.wait(pause)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
