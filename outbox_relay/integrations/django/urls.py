"""``path("admin/outbox/", include("outbox_relay.integrations.django.urls"))``, before
``path("admin/", admin.site.urls)``."""

from __future__ import annotations

from django.urls import path

from .admin import dead_letters

__all__ = ["app_name", "urlpatterns"]

app_name = "outbox_relay"
urlpatterns = [path("dead-letters/", dead_letters, name="dead_letters")]
