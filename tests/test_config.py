"""Settings: one configuration, validated where it is used, misspellings refused."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from outbox_relay import ConfigError, ProducerSettings, Settings


def test_a_misspelled_setting_is_refused_with_the_closest_name() -> None:
    with pytest.raises(
        ConfigError, match=r"OUTBOX_LEASE_SECOND \(did you mean OUTBOX_LEASE_SECONDS"
    ):
        Settings.load({}, environ={"OUTBOX_LEASE_SECOND": "30"})
    # Each named as it was written: a Celery setting, a keyword.
    with pytest.raises(
        ConfigError,
        match=r"Celery setting outbox_chunk_siz \(did you mean outbox_chunk_size\?\)",
    ):
        Settings.load({"outbox_chunk_siz": 50}, environ={})
    with pytest.raises(ConfigError, match=r"keyword batch_siz \(did you mean batch_size\?\)"):
        Settings.load({}, environ={}, batch_siz=10)
    with pytest.raises(ConfigError, match=r"OUTBOX_DNS_FILE \(did you mean OUTBOX_DSN_FILE\?\)"):
        Settings.load({}, environ={"OUTBOX_DNS_FILE": "/run/secrets/dsn"})


def test_an_environment_name_in_the_wrong_case_is_refused_not_ignored() -> None:
    """OUTBOX_lease_seconds was neither read (environment names are
    case-sensitive: the relay reads OUTBOX_LEASE_SECONDS) nor refused, as
    it counted as the known name; Outbox_DSN was not even looked at."""
    from outbox_relay.config import refuse_unknown_environment

    for written, meant in (
        ("OUTBOX_lease_seconds", "OUTBOX_LEASE_SECONDS"),
        ("Outbox_Publisher", "OUTBOX_PUBLISHER"),
        ("outbox_dsn_file", "OUTBOX_DSN_FILE"),
    ):
        pattern = rf"{written} \(not read: the relay reads {meant}, in upper case\)"
        with pytest.raises(ConfigError, match=pattern):
            Settings.load({}, environ={written: "abc"})
        # The operations CLI and producers refuse it too (with OUTBOX_table a
        # producer's rows would go to the default table).
        with pytest.raises(ConfigError, match=pattern):
            refuse_unknown_environment({written: "abc"})
    with pytest.raises(ConfigError, match=r"OUTBOX_table \(not read"):
        ProducerSettings.load({}, environ={"OUTBOX_table": "shop.outbox"})
    # Beside the right name too: which one was meant is not for us to guess.
    with pytest.raises(ConfigError, match=r"OUTBOX_lease_seconds \(not read"):
        Settings.load({}, environ={"OUTBOX_LEASE_SECONDS": "30", "OUTBOX_lease_seconds": "5"})
    # Another tool's variable in another case is not ours to refuse.
    Settings.load({}, environ={"outbox_dir": "/tmp/x", "Outbox_Theme": "dark"})
    # Still read as before: a publisher option after OUTBOX_ in any case,
    # and the tooling's own variables are still left alone.
    Settings.load(
        {}, environ={"OUTBOX_webhook_envelope": "true", "outbox_test_dsn": "x", "OUTBOX_TEST_X": ""}
    )


def test_install_refuses_a_misspelled_keyword_when_it_is_called() -> None:
    # Not only when a worker or beat starts: a web process that installs the
    # relay to send tasks through it would never see that.
    from celery import Celery

    import outbox_relay

    app = Celery("misspelled")
    with pytest.raises(ConfigError, match=r"keyword chunk_siz \(did you mean chunk_size\?\)"):
        outbox_relay.install(app, chunk_siz=50)
    with pytest.raises(ConfigError, match=r"keyword chunk_size must be a whole number, got 'x'"):
        outbox_relay.install(app, chunk_size="x")
    assert not hasattr(app, "outbox_relay")  # nothing half installed


@pytest.mark.parametrize("value", ["2.5", 2.5, True, "ten"])
def test_a_count_must_be_a_whole_number(value: Any) -> None:
    # int() would take 2.5 for 2, and True for 1, without a word.
    with pytest.raises(ConfigError, match=r"keyword chunk_size must be a whole number, got"):
        Settings.load({}, environ={}, chunk_size=value)
    assert Settings.load({}, environ={}, chunk_size=4.0).chunk_size == 4
    assert Settings.load({}, environ={"OUTBOX_CHUNK_SIZE": "4"}).chunk_size == 4
    # Seconds may have a fraction.
    assert Settings.load({}, environ={}, lease_seconds="60.5").lease_seconds == 60.5


def test_a_bad_value_is_named_as_it_was_given() -> None:
    # The value's own source, not always the environment variable: a keyword
    # in install() or a line of celeryconfig.py is where the user looks.
    with pytest.raises(ConfigError, match=r"^OUTBOX_BATCH_SIZE must be a whole number"):
        Settings.load({}, environ={"OUTBOX_BATCH_SIZE": "lots"})
    with pytest.raises(ConfigError, match=r"^Celery setting outbox_batch_size must be"):
        Settings.load({"outbox_batch_size": "lots"}, environ={"OUTBOX_BATCH_SIZE": "500"})
    with pytest.raises(ConfigError, match=r"^keyword lease_seconds must be a number"):
        Settings.load({}, environ={}, lease_seconds="soon")
    with pytest.raises(ConfigError, match=r"^Celery setting outbox_notify must be true or"):
        Settings.load({"outbox_notify": "maybe"}, environ={})


def test_names_that_read_like_celery_settings_point_to_the_right_ones() -> None:
    with pytest.raises(ConfigError, match="CELERY_BROKER_URL"):
        Settings.load({}, environ={"OUTBOX_BROKER_URL": "redis://127.0.0.1:6379/0"})
    with pytest.raises(ConfigError, match="OUTBOX_KOMBU_EXCHANGE"):
        Settings.load({}, environ={"OUTBOX_BROKER_EXCHANGE": "events"})


def test_tooling_and_other_components_names_are_not_refused() -> None:
    env = {
        "OUTBOX_TEST_DSN": "postgresql://t",
        "OUTBOX_BENCH_DSN": "postgresql://b",
        "OUTBOX_INBOX_DSN": "postgresql://inbox",
        "OUTBOX_RELAY_VERSION": "1.2",
        "OUTBOX_WEBHOOK_SECRET": "whsec_x",
        "OUTBOX_KOMBU_EXCHANGE": "events",
    }
    settings = Settings.load({}, environ=env)
    assert settings.publisher_options == {"webhook_secret": "whsec_x", "kombu_exchange": "events"}
    assert "whsec_x" not in repr(settings)


def test_producers_read_only_their_settings() -> None:
    env = {"OUTBOX_LEASE_SECONDS": "1", "OUTBOX_TABLE": "shop.events", "OUTBOX_SOMETHING": "x"}
    producer = ProducerSettings.load({}, environ=env)
    assert producer.table == "shop.events"
    with pytest.raises(ConfigError, match="OUTBOX_LEASE_SECONDS"):
        Settings.load({}, environ={"OUTBOX_LEASE_SECONDS": "1"})
    with pytest.raises(ConfigError, match="OUTBOX_MAX_PAYLOAD_BYTES"):
        ProducerSettings.load({}, environ={"OUTBOX_MAX_PAYLOAD_BYTES": "0"})


def test_ordered_event_types_match_exact_names_and_prefixes() -> None:
    producer = ProducerSettings(ordered_event_types=("order.*", "invoice.issued"))
    assert producer.is_ordered("order.paid") and producer.is_ordered("invoice.issued")
    assert not producer.is_ordered("invoice.voided") and not producer.is_ordered("orders")


def _suggested(text: str) -> dict[str, str]:
    """The ``OUTBOX_NAME=value`` fixes a lease error offers."""
    return dict(re.findall(r"(OUTBOX_[A-Z_]+)=([0-9.]+)", text))


_FIELDS = {
    "OUTBOX_LEASE_SECONDS": "lease_seconds",
    "OUTBOX_CHUNK_SIZE": "chunk_size",
    "OUTBOX_PUBLISH_CONCURRENCY": "publish_concurrency",
    "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "publish_timeout_seconds",
}


def test_a_chunk_that_does_not_fit_its_lease_says_what_to_change() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(
            chunk_size=400,
            batch_size=400,
            lease_seconds=10,
            publish_timeout_seconds=2,
            publish_concurrency=64,
        )
    text = str(caught.value)
    # ceil(400 / 64) = 7 waves x 2 s = 14 s > 10 s
    assert "14s" in text and "7 waves" in text
    # Every fix keeps the worst case within 80% of the lease.
    assert _suggested(text) == {
        "OUTBOX_LEASE_SECONDS": "18",  # 14 / 0.8 = 17.5
        "OUTBOX_CHUNK_SIZE": "256",  # 4 waves x 2 s fit in 8 s
        "OUTBOX_PUBLISH_CONCURRENCY": "100",  # ceil(400 / 4)
        "OUTBOX_PUBLISH_TIMEOUT_SECONDS": "1.1",  # 7 x 1.1 = 7.7 s
    }


def test_a_suggested_lease_past_redis_visibility_timeout_says_so() -> None:
    """OUTBOX_LEASE_SECONDS=6250 was offered; the worker then refused it
    (Redis's visibility timeout, 3600 s by default, must be longer)."""
    with pytest.raises(ConfigError) as caught:
        Settings(chunk_size=500, batch_size=500, publish_concurrency=1)
    text = str(caught.value)
    assert _suggested(text)["OUTBOX_LEASE_SECONDS"] == "6250"
    assert "also broker_transport_options visibility_timeout above it" in text


def test_a_chunk_larger_than_the_batch_says_what_to_set() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(chunk_size=500, batch_size=200)
    assert _suggested(str(caught.value)) == {
        "OUTBOX_BATCH_SIZE": "500",
        "OUTBOX_CHUNK_SIZE": "200",
    }
    Settings(chunk_size=500, batch_size=500)  # as the first fix says
    Settings(chunk_size=200, batch_size=200)  # as the second says


@pytest.mark.parametrize(
    "settings",
    [
        {
            "chunk_size": 400,
            "batch_size": 400,
            "lease_seconds": 10,
            "publish_timeout_seconds": 2,
            "publish_concurrency": 64,
        },
        # The default publish timeout (10 s) fills the whole lease: no chunk
        # size or concurrency can help, and none is offered.
        {"chunk_size": 200, "lease_seconds": 10},
        {"chunk_size": 500, "batch_size": 1000, "publish_concurrency": 64},
        {"chunk_size": 2000, "batch_size": 2000},  # 8 waves of the default 256
        {"chunk_size": 1000, "batch_size": 1000, "publish_timeout_seconds": 20},
        {"lease_seconds": 5},  # per-message: the publish timeout alone
    ],
)
def test_each_suggested_fix_is_enough_on_its_own(settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(**settings)
    fixes = _suggested(str(caught.value))
    assert "OUTBOX_LEASE_SECONDS" in fixes and "OUTBOX_PUBLISH_TIMEOUT_SECONDS" in fixes
    for name, value in fixes.items():
        field = _FIELDS[name]
        fixed = Settings(**{**settings, field: type(getattr(Settings(), field))(float(value))})
        assert fixed.worst_delivery_seconds <= 0.8 * fixed.lease_seconds + 1e-9, name


def test_every_database_call_is_bounded_within_the_lease() -> None:
    assert Settings().database_timeout == 10
    assert Settings(lease_seconds=6, publish_timeout_seconds=1).database_timeout == 2
    with pytest.raises(ConfigError, match="OUTBOX_DATABASE_TIMEOUT_SECONDS"):
        Settings(lease_seconds=20, database_timeout_seconds=30)


def test_the_finalize_window_is_a_fraction_of_a_second_or_off() -> None:
    assert Settings().finalize_window_seconds == 0.02
    assert Settings(finalize_window_seconds=0).finalize_window_seconds == 0  # done in the task
    for bad in (-0.1, 5):
        with pytest.raises(ConfigError, match=r"OUTBOX_FINALIZE_WINDOW_SECONDS must be between"):
            Settings(finalize_window_seconds=bad)


def test_the_rescuer_ticks_with_the_claim_unless_told_otherwise() -> None:
    assert Settings(claim_interval_seconds=2).rescue_interval == 2
    assert Settings(rescue_interval_seconds=7).rescue_interval == 7
    with pytest.raises(ConfigError, match="OUTBOX_RESCUE_INTERVAL_SECONDS"):
        Settings(rescue_interval_seconds=0)


def test_a_misspelled_publisher_option_is_refused_not_ignored() -> None:
    from celery import Celery

    import outbox_relay
    from outbox_relay.publishers import resolve_publisher

    # Ignored, it would send every webhook unsigned: refused where it was
    # written, whichever publisher is in use.
    for publisher in ("https://example.com/h", "amqp://guest@127.0.0.1//"):
        with pytest.raises(
            ConfigError, match=r"OUTBOX_WEBHOOK_SECERT \(did you mean OUTBOX_WEBHOOK_SECRET\?"
        ):
            Settings.load(
                {}, environ={"OUTBOX_WEBHOOK_SECERT": "whsec_x", "OUTBOX_PUBLISHER": publisher}
            )
    with pytest.raises(ConfigError, match=r"Celery setting outbox_kombu_exchanges \(did you mean "):
        Settings.load({"outbox_kombu_exchanges": "events"}, environ={})
    app = Celery("typo", broker="memory://", set_as_current=False)
    with pytest.raises(
        ConfigError, match=r"keyword webhook_secert \(did you mean webhook_secret\?"
    ):
        outbox_relay.install(app, dsn="postgresql://db/app", webhook_secert="whsec_x")
    assert not hasattr(app, "outbox_relay")
    # Every documented option is known, with its _file form.
    Settings.load({}, environ={"OUTBOX_KOMBU_EXCHANGE": "events", "OUTBOX_CELERY_QUEUE": "q"})
    # A publisher built directly still names what it does not know.
    with pytest.raises(ConfigError, match="OUTBOX_KOMBU_EXCHANGES"):
        resolve_publisher("amqp://guest@127.0.0.1//", kombu_exchanges="events")


def test_install_refuses_what_it_would_ignore() -> None:
    from celery import Celery

    import outbox_relay

    app = Celery("refusals", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'max_retrys' \(did you mean 'max_retries'\?\)"):
        outbox_relay.install(app, dsn="postgresql://db/app", task_options={"max_retrys": 3})
    with pytest.raises(outbox_relay.InvalidIdentifier, match="events-outbox"):
        outbox_relay.install(app, dsn="postgresql://db/app", table="billing.events-outbox")
    assert not hasattr(app, "outbox_relay")
    first = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    # The same call again (a module imported twice) returns the installation...
    assert outbox_relay.install(app, dsn="postgresql://db/app", publisher=print) is first
    # ...another one is refused, not ignored: its table would never be relayed.
    with pytest.raises(ConfigError, match="already installed in Celery app 'refusals'"):
        outbox_relay.Outbox(table="shipping.events_outbox").install(app, queue="q2")


def test_install_beat_false_leaves_the_schedule_to_the_user() -> None:
    from celery import Celery

    import outbox_relay

    mine = Celery("mine", broker="memory://", set_as_current=False)
    mine.conf.beat_schedule = {"nightly": {"task": "shop.report", "schedule": 86400}}
    outbox_relay.install(mine, dsn="postgresql://db/app", publisher=print, beat=False)
    assert sorted(mine.conf.beat_schedule) == ["nightly"]
    theirs = Celery("theirs", broker="memory://", set_as_current=False)
    outbox_relay.install(theirs, dsn="postgresql://db/app", publisher=print)
    assert {"outbox-relay-claim", "outbox-relay-rescue", "outbox-relay-purge"} <= set(
        theirs.conf.beat_schedule
    )
    # Each app runs its own relay tasks, bound to its own installation: a later
    # app never picks up an earlier app's tasks (Celery's shared tasks would).
    later = Celery("later", broker="memory://", set_as_current=False)
    assert "outbox_relay.claim" not in later.tasks
    assert mine.tasks["outbox_relay.claim"] is not theirs.tasks["outbox_relay.claim"]


def test_the_app_s_rate_limits_do_not_reach_the_relay_s_tasks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """task_annotations={"*": {"rate_limit": ...}} (or a default rate limit)
    held deliveries in the worker's bucket past their expiry: 300 messages
    took 2.5 minutes behind 50/s, each dropped one waiting out its lease."""
    from celery import Celery

    import outbox_relay

    for conf in (
        {"task_annotations": {"*": {"rate_limit": "5/s"}}},
        {"task_default_rate_limit": "5/s"},
    ):
        app = Celery("limited", broker="memory://", set_as_current=False)
        app.conf.update(conf)

        @app.task(name="shop.mail", shared=False)
        def mail() -> None: ...

        outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
        caplog.clear()
        app.finalize()
        assert app.tasks["shop.mail"].rate_limit == "5/s"  # the app's own keep theirs
        for name in ("outbox_relay.claim", "outbox_relay.deliver", "outbox_relay.deliver_batch"):
            assert app.tasks[name].rate_limit is None, (conf, name)
        assert "which the relay ignores" in caplog.text
        assert "OUTBOX_MAX_IN_FLIGHT" in caplog.text


def test_a_producer_setting_of_the_app_that_the_outbox_contradicts_is_refused() -> None:
    """app.conf.outbox_ordered_event_types with Outbox().install(app) was
    silently ignored: ordering off, the start-up checks passed."""
    from celery import Celery

    import outbox_relay

    app = Celery("ordered", broker="memory://", set_as_current=False)
    app.conf.update(outbox_ordered_event_types=["order.*"], outbox_max_payload_bytes=1000)
    inst = outbox_relay.Outbox(max_payload_bytes=1000).install(
        app, dsn="postgresql://db/app", publisher=print
    )
    with pytest.raises(
        ConfigError,
        match=r"Celery setting outbox_ordered_event_types=\('order\.\*',\) is a producer setting",
    ):
        inst.validate()
    # The same values in both places are no contradiction; without an
    # Outbox, install() makes one from them.
    agreed = Celery("agreed", broker="memory://", set_as_current=False)
    agreed.conf.update(outbox_ordered_event_types=["order.*"])
    outbox = outbox_relay.Outbox(ordered_event_types=["order.*"])
    outbox.install(agreed, dsn="postgresql://db/app", publisher=print).validate()
    made = Celery("made", broker="memory://", set_as_current=False)
    made.conf.update(outbox_ordered_event_types=["order.*"])
    inst = outbox_relay.install(made, dsn="postgresql://db/app", publisher=print)
    inst.validate()
    assert inst.outbox.settings.ordered_event_types == ("order.*",)


def test_relay_tasks_routed_to_an_undeclared_queue_name_the_fix() -> None:
    """With task_create_missing_queues off, a route of outbox_relay.* to a
    queue missing from task_queues stopped the worker with a traceback
    through Celery's router."""
    from celery import Celery
    from kombu import Queue

    import outbox_relay

    app = Celery("routed", broker="memory://", set_as_current=False)
    app.conf.update(
        task_queues=[Queue("default")],
        task_create_missing_queues=False,
        task_routes={"outbox_relay.*": {"queue": "relay"}},
    )
    inst = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    with pytest.raises(ConfigError, match=r"'relay'.*add it to task_queues"):
        inst.relay_queue()


def test_a_misspelled_setting_under_celerys_namespace_is_refused() -> None:
    """Django's ``CELERY_OUTBOX_LEASE_SECONDS`` is read (Celery strips its
    namespace), but ``CELERY_OUTBOX_LEAES_SECONDS`` was not refused: the
    check looked only at lower-case ``outbox_*`` keys."""
    from celery import Celery

    import outbox_relay

    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_OUTBOX_LEAES_SECONDS = 3

    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    inst = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    expected = (
        r"unknown outbox setting\(s\): Celery setting CELERY_OUTBOX_LEAES_SECONDS "
        r"\(did you mean CELERY_OUTBOX_LEASE_SECONDS\?\)"
    )
    with pytest.raises(ConfigError, match=expected):
        inst.settings  # noqa: B018 (loading validates)


def test_django_celery_outbox_settings_are_not_taken_for_misspelled_ones() -> None:
    """A Django project moving from django-celery-outbox keeps its
    ``CELERY_OUTBOX_APP`` (which that package's system check and relay
    require while it is installed) until the old table is drained. Celery
    reads it under its namespace as ``outbox_app``, and the relay's worker
    and beat refused to start: "unknown outbox setting(s): Celery setting
    CELERY_OUTBOX_APP". A misspelling of the relay's own is still refused."""
    from celery import Celery

    import outbox_relay

    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_OUTBOX_APP = "proj.celery.app"
        CELERY_OUTBOX_EXCLUDE_TASKS = ("outbox_relay.claim",)
        CELERY_OUTBOX_STALE_TIMEOUT_SECONDS = 300
        CELERY_OUTBOX_LEASE_SECONDS = 45

    app = Celery("migrating", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    inst = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    assert inst.settings.lease_seconds == 45

    class Misspelled(DjangoSettings):
        CELERY_OUTBOX_LEAES_SECONDS = 3

    app = Celery("misspelled", set_as_current=False)
    app.config_from_object(Misspelled, namespace="CELERY")
    inst = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    with pytest.raises(
        ConfigError,
        match=r"^unknown outbox setting\(s\): Celery setting "
        r"CELERY_OUTBOX_LEAES_SECONDS \(did you mean",
    ):
        inst.settings  # noqa: B018 (loading validates)


def test_install_keeps_the_users_task_routes_as_written() -> None:
    """install() turned a task_routes dict into a tuple (with its router
    appended): ``app.conf.task_routes.update(...)`` afterwards raised
    AttributeError. The relay's route now lives in Celery's router only,
    after the user's routes, and survives Celery's own rebuilds of it."""
    from celery import Celery

    import outbox_relay

    app = Celery("routes", broker="memory://", set_as_current=False)
    routes = {"shop.charge": {"queue": "billing"}}
    app.conf.task_routes = routes
    outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    app.finalize()

    def queue(name: str) -> str:
        return str(app.amqp.router.route({}, name, (), {})["queue"].name)

    assert app.conf.task_routes is routes
    assert (queue("outbox_relay.claim"), queue("shop.charge")) == ("outbox", "billing")
    app.conf.task_routes.update({"shop.refund": {"queue": "refunds"}})
    # conf.update() is how Celery learns of new routes; it rebuilds its router.
    app.conf.update(task_routes={**routes, "outbox_relay.deliver": {"queue": "relay"}})
    assert queue("outbox_relay.claim") == "outbox"  # still the relay's route
    assert queue("outbox_relay.deliver") == "relay"  # the user's route wins
    assert queue("shop.charge") == "billing"


def test_beat_says_so_when_the_relay_s_entries_were_replaced(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """beat_schedule assigned after install() on a configured app replaced
    the relay's entries: beat never claimed or rescued again, silently."""
    from celery import Celery, signals

    import outbox_relay

    class Beat:  # what beat_init's sender carries: its app
        def __init__(self, app: Celery) -> None:
            self.app = app

    app = Celery("replaced", broker="memory://", set_as_current=False)
    app.conf.timezone  # noqa: B018 (reading a setting configures the app)
    outbox_relay.install(app, dsn=dsn, publisher=print)
    app.conf.beat_schedule = {"nightly": {"task": "shop.report", "schedule": 86400}}
    signals.beat_init.send(sender=Beat(app))
    assert "beat's schedule has no entry for outbox_relay.claim and outbox_relay.rescue" in (
        caplog.text
    )
    caplog.clear()
    app.conf.beat_schedule = {}
    kept = Celery("kept", broker="memory://", set_as_current=False)
    outbox_relay.install(kept, dsn=dsn, publisher=print)
    kept.conf.beat_schedule.update({"nightly": {"task": "shop.report", "schedule": 86400}})
    signals.beat_init.send(sender=Beat(kept))
    assert "no entry" not in caplog.text


def test_celery_retry_backoff_keeps_celerys_schedule() -> None:
    """retry_backoff=N: the first retry waits N seconds, then 2N, 4N, as
    Celery's own autoretry would (it was 2N, 4N, 8N); the relay's own
    OUTBOX_BACKOFF_BASE_SECONDS keeps its base x 2^attempts."""
    from datetime import timedelta

    from outbox_relay.celery.options import retry_policy

    settings = Settings.load({}, environ={}, backoff_base_seconds=3)

    def delays(options: dict[str, Any]) -> list[float]:
        policy = retry_policy(settings, {"retry_jitter": False, **options}, {})
        return [policy.backoff(attempt).total_seconds() for attempt in (1, 2, 3)]

    assert delays({"retry_backoff": 2}) == [2.0, 4.0, 8.0]
    assert delays({"retry_backoff": True}) == [1.0, 2.0, 4.0]
    assert delays({"retry_backoff": 2, "retry_backoff_max": 5}) == [2.0, 4.0, 5.0]
    assert delays({}) == [6.0, 12.0, 24.0]  # the relay's own base, 3 s
    constant = retry_policy(settings, {"retry_backoff": False, "default_retry_delay": 7}, {})
    assert constant.backoff(3) == timedelta(seconds=7)


def test_retry_backoff_zero_is_no_backoff_as_in_celery_and_a_negative_one_is_refused() -> None:
    """retry_backoff=0 was read as a factor of 0: every attempt spent in
    milliseconds (Celery tests it for truth: the constant default_retry_delay).
    A negative option started, then crashed every failed delivery
    (ValueError in the backoff), its row waiting out a lease each time."""
    from datetime import timedelta

    from celery import Celery

    import outbox_relay
    from outbox_relay.celery.options import retry_policy

    settings = Settings.load({}, environ={})
    for off in (0, 0.0, None, False):
        policy = retry_policy(settings, {"retry_backoff": off, "retry_jitter": False}, {})
        assert policy.backoff(1) == timedelta(seconds=180), off
    for name, value in (("retry_backoff", -1), ("retry_backoff_max", -5), ("retry_backoff", "x")):
        with pytest.raises(ConfigError, match=f"task option {name} must be a number of seconds"):
            retry_policy(settings, {name: value}, {})
    app = Celery("negative", broker="memory://", set_as_current=False)
    app.conf.task_annotations = {"outbox_relay.deliver": {"retry_backoff": -1}}
    inst = outbox_relay.install(app, dsn="postgresql://db/app", publisher=print)
    with pytest.raises(ConfigError, match="retry_backoff must be a number of seconds >= 0"):
        inst.validate()


def test_an_empty_value_leaves_an_optional_setting_unset() -> None:
    # OUTBOX_OWNER= in a .env file reaches the process as an empty string
    # (docker compose passes ${OUTBOX_OWNER:-} on as it is).
    empty = {"OUTBOX_OWNER": "", "OUTBOX_RESCUE_INTERVAL_SECONDS": " ",
             "OUTBOX_DATABASE_TIMEOUT_SECONDS": "", "OUTBOX_PUBLISHER_OPTIONS": ""}  # fmt: skip
    assert Settings.load({}, environ=empty) == Settings()
    # A setting that is not optional still refuses it.
    with pytest.raises(ConfigError, match="OUTBOX_LEASE_SECONDS must be a number"):
        Settings.load({}, environ={"OUTBOX_LEASE_SECONDS": ""})


def test_a_publisher_module_in_the_current_directory_says_how_to_import_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery imports the -A app and its config module from the current
    directory; a publisher module beside them was only "No module named"."""
    from outbox_relay.publishers.protocol import load_callable

    name = f"here_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def publish(message):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"is in the current directory.*PYTHONPATH=\."):
        load_callable(f"{name}:publish")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert callable(load_callable(f"{name}:publish"))  # as the hint says
