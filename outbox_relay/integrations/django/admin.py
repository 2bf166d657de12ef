"""A dead-letter page in Django's admin: list dead messages, retry or skip them.

The work is ``outbox_relay.operations`` (the same calls as ``outbox-relay
dead list|retry|skip``) on Django's connection to the outbox database. Any
staff user may look; retry and skip need a superuser, as they change what is
delivered. Mounted by ``urls.py`` under Django's admin login.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse

from ... import operations
from ._producer import psycopg_connection
from .conf import database_alias, outbox

__all__ = ["dead_letters"]

PAGE_SIZE = 100
_ACTIONS = {"retry": operations.dead_retry, "skip": operations.dead_skip}


def _act(request: HttpRequest, conn: Any) -> None:
    action = request.POST.get("action", "")
    if action not in _ACTIONS:
        messages.error(request, f"unknown action {action!r}: choose retry or skip")
        return
    if not getattr(request.user, "is_superuser", False):
        raise PermissionDenied("retrying or skipping dead letters needs a superuser")
    try:
        ids = sorted({int(i) for i in request.POST.getlist("ids")})
    except ValueError:
        messages.error(request, "message ids must be whole numbers")
        return
    if not ids:
        messages.warning(request, "select at least one message")
        return
    changed = _ACTIONS[action](conn, ids, table=outbox().table)
    done = "sent back to pending" if action == "retry" else "marked done without delivery"
    messages.success(request, f"{len(changed)} message(s) {done}: {changed}")
    missed = sorted(set(ids) - set(changed))
    if missed:
        messages.warning(request, f"not dead (or gone), left alone: {missed}")


def _view(request: HttpRequest) -> HttpResponse:
    conn = psycopg_connection(database_alias())
    if request.method == "POST":
        _act(request, conn)
        return HttpResponseRedirect(request.path)
    rows = operations.dead_list(conn, limit=PAGE_SIZE, table=outbox().table)
    context = {
        **admin.site.each_context(request),
        "title": "Outbox dead letters",
        "rows": rows,
        "page_size": PAGE_SIZE,
        "table": outbox().table.qualified,
        "can_act": getattr(request.user, "is_superuser", False),
    }
    return TemplateResponse(request, "outbox_relay/dead_letters.html", context)


# admin_view: staff login required, CSRF checked on POST, never cached.
dead_letters = admin.site.admin_view(_view)
