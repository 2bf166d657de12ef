"""The Django app config: ``INSTALLED_APPS = [..., "outbox_relay.integrations.django"]``."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["OutboxRelayConfig"]


class OutboxRelayConfig(AppConfig):  # type: ignore[misc]  # django ships no types
    name = "outbox_relay.integrations.django"
    label = "outbox_relay"
    verbose_name = "Outbox relay"

    def ready(self) -> None:
        # Read OUTBOX_* now and make it this process's default outbox, so a
        # bad setting fails at start and every producer uses the same table
        # and ordering as the relay.
        from .conf import database_alias, outbox

        outbox().settings  # noqa: B018 - loading validates
        # enqueue writes to OUTBOX_DATABASE: a name missing from DATABASES
        # fails here, not only in the relay's worker.
        database_alias()
