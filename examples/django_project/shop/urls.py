from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    # The outbox's dead-letter page, under the admin's login.
    path("admin/outbox/", include("outbox_relay.integrations.django.urls")),
    path("admin/", admin.site.urls),
    path("", include("orders.urls")),
]
