"""``outbox_relay.apply_async`` on a Django connection, for tests/test_celery_canvas.py.

``python -m tests.apps.django_canvas DSN`` writes one canvas in a committed
``atomic`` block and one in a rolled-back block, and prints their root ids.
"""

from __future__ import annotations

import json
import sys

from .django_check import Boom, configure


def main(dsn: str) -> dict[str, str]:
    configure(dsn)
    from django.db import connection, transaction

    import outbox_relay

    from .canvas import step

    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO orders (id) VALUES (1)")
        kept = outbox_relay.apply_async(connection, step.s(tag="kept"))
    try:
        with transaction.atomic():
            dropped = outbox_relay.apply_async(connection, step.s(tag="dropped"))
            raise Boom
    except Boom:
        pass
    return {"kept": kept.id, "dropped": dropped.id}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
