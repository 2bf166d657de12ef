"""The claims a process sends for when waiting rows fall due (celery/wake.py).

The end-to-end behaviour (a retry and a delayed message claimed when due, not
at beat's next tick) is in tests/test_celery_relay.py and
tests/test_durable.py; here, that a storm of failures sends only a few
wake-ups, and that none is sent when the tick comes first.
"""

from __future__ import annotations

import random

import pytest

from outbox_relay.celery.wake import WAKE_MARGIN_SECONDS, WAKE_SLACK_SECONDS, WakeSchedule


def test_a_row_due_after_the_next_tick_sends_nothing() -> None:
    wake = WakeSchedule()
    assert wake.take(5.0, within=5.0) is None
    assert wake.take(60.0, within=5.0) is None


def test_the_countdown_is_the_delay_and_a_margin() -> None:
    wake = WakeSchedule()
    countdown = wake.take(0.8, within=5.0)
    assert countdown is not None
    # The countdown is a difference of monotonic readings: exact to a float's grain.
    assert countdown == pytest.approx(0.8 + WAKE_MARGIN_SECONDS, abs=1e-6)
    # A row already due (a release) is claimed at once.
    assert WakeSchedule().take(-3.0, within=5.0) == pytest.approx(WAKE_MARGIN_SECONDS)


def test_a_later_row_rides_on_a_claim_already_sent_an_earlier_one_does_not() -> None:
    wake = WakeSchedule()
    assert wake.take(1.0, within=5.0) is not None
    # Due later: the claim at 1 s takes what is due then and looks up the rest.
    assert wake.take(3.0, within=5.0) is None
    # Due within the slack after it: that claim serves it too.
    assert wake.take(1.0 + WAKE_SLACK_SECONDS / 2, within=5.0) is None
    # Due well before it: a claim of its own.
    assert wake.take(0.2, within=5.0) is not None


def test_a_storm_of_failures_sends_a_few_wake_ups() -> None:
    """A thousand rows rescheduled at once with full-jitter delays."""
    wake = WakeSchedule()
    rng = random.Random(7)
    sent = [c for _ in range(1000) if (c := wake.take(rng.uniform(0, 1.0), within=5.0))]
    # Each one sent is earlier than every one before it by more than the slack.
    assert 1 <= len(sent) <= 1 + int(1.0 / WAKE_SLACK_SECONDS)
    assert sent == sorted(sent, reverse=True)


def test_a_forked_process_forgets_its_parents_claims() -> None:
    wake = WakeSchedule()
    assert wake.take(2.0, within=5.0) is not None
    assert wake.take(2.0, within=5.0) is None
    wake.reset()
    assert wake.take(2.0, within=5.0) is not None
