"""A relay host's network link cut and restored, with the hosts in their own
network namespaces (veth pairs to this machine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..tcp_proxy import SilencingProxy
from . import network
from .harness import LATE_REQUEST, LEASE_LOST, LOST_RESPONSE, Run
from .servers import OwnedRedis

pytestmark = [pytest.mark.faults, pytest.mark.celery]

CUT_SECONDS = 20.0  # longer than the lease (8 s): the other host takes the rows over


def _via(proxy_host: str, dsn: str) -> tuple[SilencingProxy, str]:
    params = conninfo_to_dict(dsn)
    proxy = SilencingProxy(
        target=(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)),
        listen=proxy_host,
    )
    return proxy, make_conninfo(dsn, host=proxy_host, port=proxy.port)


def test_a_relay_hosts_link_cut_and_restored(
    dsn: str, fresh_database: str, tmp_path: Path, owned_redis: OwnedRedis
) -> None:
    why = network.available()
    if why is not None:
        pytest.skip(why)
    if conninfo_to_dict(dsn).get("host", "").startswith("/"):
        pytest.skip("the database listens on a Unix socket only: not reachable from a namespace")
    hosts = [network.Host() for _ in range(2)]
    proxies: list[SilencingProxy] = []
    run = Run(
        "link-cut", dsn, fresh_database, tmp_path, broker=owned_redis.url, receiver_bind="0.0.0.0"
    )
    try:
        envs = []
        for host in hosts:
            outbox, outbox_dsn = _via(host.gateway, dsn)
            evidence, evidence_dsn = _via(host.gateway, fresh_database)
            broker = SilencingProxy(target=("127.0.0.1", owned_redis.port), listen=host.gateway)
            proxies += [outbox, evidence, broker]
            envs.append(
                {
                    "OUTBOX_DSN": outbox_dsn,
                    "CELERY_BROKER_URL": f"redis://{host.gateway}:{broker.port}/0",
                    "FAULT_WEBHOOK_URL": run.receiver.url_at(host.gateway),
                    "FAULT_DSN": evidence_dsn,
                }
            )
        cut, other = hosts
        victim = run.procs.worker(concurrency=2, env=envs[0], netns=cut.name)
        run.procs.worker(concurrency=2, env=envs[1], netns=other.name)
        run.procs.beat(env=envs[1], netns=other.name)
        run.enqueue(1000)
        with run.producing():
            time.sleep(2)
            with run.fault("link cut"):
                cut.cut()
                time.sleep(CUT_SECONDS)
                cut.restore()
        before = victim.text().count("succeeded in")
        run.enqueue(600)  # work for both hosts after the link is back
        run.faults.append(
            f"one of two relay hosts (netns) cut off for {CUT_SECONDS:g} s, no FIN/RST, "
            "then restored"
        )
        run.wait_finished(180)
        # Requests in flight when the link went down reach the receiver when
        # it comes back, after the other host delivered the same message.
        run.ledger(allow={LEASE_LOST, LOST_RESPONSE, LATE_REQUEST})
        assert victim.alive(), victim.text()[-3000:]
        # The other host may have drained the rest before the cut one's
        # broker connection came back (its reconnect backs off); the beat's
        # claims reach both, so the cut host runs some within seconds.
        deadline = time.monotonic() + 30
        while victim.text().count("succeeded in") <= before:
            assert time.monotonic() < deadline, (
                "the cut host never worked again:\n" + victim.text()[-3000:]
            )
            time.sleep(0.5)
        assert victim.alive(), victim.text()[-3000:]
    finally:
        run.close()
        for proxy in proxies:
            proxy.close()
        for host in hosts:
            host.close()
