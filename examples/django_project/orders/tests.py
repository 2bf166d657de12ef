"""The example's own tests: ``python manage.py test`` (needs SHOP_DATABASE's server).

TransactionTestCase, not TestCase: what these tests check is what a commit
and a rollback leave, and TestCase would wrap everything in one transaction.
The outbox table is not a Django model, so each test empties it itself.
"""

from decimal import Decimal

from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client, TransactionTestCase

import outbox_relay
from outbox_relay import InvalidMessage, OperationKeyConflict, store
from outbox_relay.integrations.django import enqueue, psycopg_connection

from .models import Order
from .services import PaymentDeclined, place_order


def event(aggregate_id: int, **kw: object) -> dict:
    fields = {
        "aggregate_type": "order",
        "aggregate_id": aggregate_id,
        "event_type": "order.created",
        "payload": {"id": aggregate_id},
    }
    fields.update(kw)
    return fields


def outbox_rows() -> list[tuple]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT aggregate_id, event_type, status, operation_key FROM outbox ORDER BY id"
        )
        return cur.fetchall()


class OutboxTests(TransactionTestCase):
    def setUp(self) -> None:
        with connection.cursor() as cur:
            cur.execute("DELETE FROM outbox")

    def test_manage_py_migrate_created_the_outbox_table(self) -> None:
        # The app's Django migration ran every outbox migration.
        self.assertEqual(store.missing_migrations(psycopg_connection()), [])

    def test_the_order_and_its_event_commit_together(self) -> None:
        order = place_order("ada", Decimal("12.50"))
        self.assertTrue(Order.objects.filter(pk=order.pk).exists())
        self.assertEqual(
            outbox_rows(),
            [(str(order.pk), "order.created", "pending", f"order-created-{order.pk}")],
        )
        # OUTBOX_ORDERED_EVENT_TYPES from settings.py decided the row's ordering.
        with connection.cursor() as cur:
            cur.execute("SELECT ordered FROM outbox")
            self.assertEqual(cur.fetchone(), (True,))

    def test_a_failure_after_enqueue_rolls_back_both(self) -> None:
        with self.assertRaises(PaymentDeclined):
            place_order("bob", Decimal("1"), decline=True)
        self.assertFalse(Order.objects.exists())
        self.assertEqual(outbox_rows(), [])

    def test_an_operation_key_conflict_raises_and_the_atomic_block_goes_on(self) -> None:
        order = place_order("eve", Decimal("2"))
        key = f"order-created-{order.pk}"
        same = {"id": order.pk, "customer": "eve", "total": "2"}
        with connection.cursor() as cur:
            cur.execute("SELECT id FROM outbox")
            [(first,)] = cur.fetchall()
        with transaction.atomic():
            # The same operation again: the same message.
            self.assertEqual(enqueue(**event(order.pk, operation_key=key, payload=same)), first)
            with self.assertRaises(OperationKeyConflict):
                enqueue(**event(order.pk, operation_key=key))  # other content
            Order.objects.create(customer="after the conflict", total=Decimal("1"))
        self.assertEqual([r[0] for r in outbox_rows()], [str(order.pk)])
        self.assertTrue(Order.objects.filter(customer="after the conflict").exists())

    def test_a_refused_message_leaves_the_atomic_block_usable(self) -> None:
        with transaction.atomic():
            with self.assertRaisesMessage(InvalidMessage, "payload must be JSON-serializable"):
                enqueue(**event(1, payload={"when": object()}))
            Order.objects.create(customer="still here", total=Decimal("1"))
        self.assertTrue(Order.objects.filter(customer="still here").exists())
        self.assertEqual(outbox_rows(), [])

    def test_an_ordered_event_holds_its_aggregates_lock_until_commit(self) -> None:
        def advisory_locks() -> int:
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND pid = pg_backend_pid()"
                )
                return cur.fetchone()[0]

        with transaction.atomic():
            enqueue(**event(3))  # order.* is ordered in settings.py
            self.assertEqual(advisory_locks(), 1)
        self.assertEqual(advisory_locks(), 0)

    def test_the_json_view_places_an_order(self) -> None:
        response = Client().post(
            "/orders", {"customer": "cy", "total": "3"}, content_type="application/json"
        )
        self.assertEqual(response.status_code, 201)
        self.assertEqual(outbox_rows()[0][0], str(response.json()["id"]))

    def test_the_relay_is_configured_from_settings_py(self) -> None:
        from django.conf import settings
        from shop.celery import app

        relay = app.outbox_relay.settings
        self.assertEqual(relay.publisher, settings.OUTBOX_PUBLISHER)
        self.assertEqual(relay.lease_seconds, 30)
        self.assertEqual(relay.ordered_event_types, ("order.*",))
        # No OUTBOX_DSN: the relay connects to DATABASES["default"].
        self.assertIn(f"dbname={connection.settings_dict['NAME']}", relay.require_dsn())

    def test_producer_settings_belong_to_settings_py(self) -> None:
        from celery import Celery

        from outbox_relay import ConfigError
        from outbox_relay.integrations.django import install

        # The table and ordering are shared with producers: settings.py only.
        with self.assertRaisesMessage(ConfigError, "set OUTBOX_TABLE in settings.py"):
            install(Celery("other"), table="elsewhere")

    def test_a_misspelled_setting_is_named_where_it_was_written(self) -> None:
        from celery import Celery
        from django.test import override_settings

        from outbox_relay import ConfigError
        from outbox_relay.integrations.django import install

        with (
            override_settings(OUTBOX_CHUNK_SIZ=50),
            self.assertRaisesMessage(
                ConfigError, "settings.py OUTBOX_CHUNK_SIZ (did you mean OUTBOX_CHUNK_SIZE?)"
            ),
        ):
            install(Celery("misspelled"))
        with self.assertRaisesMessage(
            ConfigError, "keyword lease_second (did you mean lease_seconds?)"
        ):
            install(Celery("misspelled"), lease_second=30)

    def test_a_misspelled_producer_setting_stops_the_producers_too(self) -> None:
        from django.test import override_settings

        from outbox_relay import ConfigError
        from outbox_relay.integrations.django import conf

        # OUTBOX_TABEL: the web process wrote to the default table, which
        # nobody relayed; only the relay's worker named the typo.
        made, conf._outbox = conf._outbox, None
        try:
            with (
                override_settings(OUTBOX_TABEL="shop.events_outbox"),
                self.assertRaisesMessage(
                    ConfigError, "settings.py OUTBOX_TABEL (did you mean OUTBOX_TABLE?)"
                ),
            ):
                conf.outbox()
        finally:
            conf._outbox = made

    def test_a_bad_value_is_named_where_it_was_written(self) -> None:
        from celery import Celery
        from django.test import override_settings

        from outbox_relay import ConfigError
        from outbox_relay.integrations.django import install

        # settings.py's values reach the relay as keywords; the error still
        # names the line of settings.py, not a keyword nobody wrote.
        with (
            override_settings(OUTBOX_CHUNK_SIZE=2.5),
            self.assertRaisesMessage(
                ConfigError, "settings.py OUTBOX_CHUNK_SIZE must be a whole number, got 2.5"
            ),
        ):
            install(Celery("bad-value"))
        with self.assertRaisesMessage(
            ConfigError, "keyword lease_seconds must be a number, got 'soon'"
        ):
            install(Celery("bad-value"), lease_seconds="soon")


class DeadLetterAdminTests(TransactionTestCase):
    url = "/admin/outbox/dead-letters/"

    def setUp(self) -> None:
        with connection.cursor() as cur:
            cur.execute("DELETE FROM outbox")
        order = place_order("dee", Decimal("5"))
        with connection.cursor() as cur:
            # What the relay leaves after the last attempt failed.
            cur.execute(
                "UPDATE outbox SET status = 'dead', attempts = 12,"
                " last_error = 'HTTP 410 from the receiver' WHERE aggregate_id = %s"
                " RETURNING id",
                [str(order.pk)],
            )
            self.dead_id = cur.fetchone()[0]

    def status(self) -> str:
        return outbox_relay.store.get_row(psycopg_connection(), self.dead_id)["status"]

    def test_anonymous_users_are_sent_to_the_login(self) -> None:
        response = Client().get(self.url)
        self.assertEqual(response.status_code, 302)
        self.assertIn("/admin/login/", response["Location"])

    def test_staff_see_the_dead_letters(self) -> None:
        staff = User.objects.create_user("staff", password="x", is_staff=True)
        client = Client()
        client.force_login(staff)
        response = client.get(self.url)
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "HTTP 410 from the receiver")
        self.assertContains(response, f"<td>{self.dead_id}</td>", html=False)
        self.assertContains(response, "need a superuser")
        # Looking is allowed; acting is not.
        denied = client.post(self.url, {"action": "retry", "ids": [self.dead_id]})
        self.assertEqual(denied.status_code, 403)
        self.assertEqual(self.status(), "dead")

    def test_a_superuser_retries_and_skips(self) -> None:
        admin = User.objects.create_superuser("root", password="x")
        client = Client()
        client.force_login(admin)
        self.assertContains(client.get(self.url), 'name="ids"')
        response = client.post(self.url, {"action": "retry", "ids": [self.dead_id]}, follow=True)
        self.assertContains(response, "1 message(s) sent back to pending")
        self.assertEqual(self.status(), "pending")
        with connection.cursor() as cur:
            cur.execute("UPDATE outbox SET status = 'dead' WHERE id = %s", [self.dead_id])
        response = client.post(self.url, {"action": "skip", "ids": [self.dead_id]}, follow=True)
        self.assertContains(response, "marked done without delivery")
        self.assertEqual(self.status(), "done")
        self.assertContains(client.get(self.url), "No dead messages.")
