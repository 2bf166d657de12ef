"""Where a drain's next claim goes (fan_out's placement).

The drain end to end, with real workers and no beat:
tests/test_celery_relay.py::test_a_drain_under_the_cap_goes_on_without_beat.
"""

from __future__ import annotations

from outbox_relay.celery.fanout import DrainPlan, drain_plan


def test_a_round_longer_than_the_prefetch_queues_its_claim_halfway() -> None:
    # 200 tasks, a worker of 4 processes prefetching 16: the claim is reached
    # when half the round has been taken.
    assert drain_plan(200, prefetched=16, tight=False) == DrainPlan(queued_at=100)


def test_a_round_the_worker_prefetches_whole_lets_its_middle_task_send_the_claim() -> None:
    # 10 chunks of 50 from a batch of 500: a claim queued among them would run
    # at once and find the cap still held by this very round.
    assert drain_plan(10, prefetched=16, tight=False) == DrainPlan(marked=5, when="start")
    assert drain_plan(32, prefetched=16, tight=False) == DrainPlan(marked=16, when="start")
    assert drain_plan(33, prefetched=16, tight=False) == DrainPlan(queued_at=16)


def test_under_a_tight_cap_the_claim_waits_for_finished_rows() -> None:
    # Only finished rows make room: the middle task claims once it is done,
    # however long the round.
    assert drain_plan(2, prefetched=16, tight=True) == DrainPlan(marked=1, when="end")
    assert drain_plan(200, prefetched=16, tight=True) == DrainPlan(marked=100, when="end")
    assert drain_plan(1, prefetched=16, tight=True) == DrainPlan(marked=0, when="end")
