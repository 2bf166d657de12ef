"""Placing an order: the order and its event in one transaction."""

from decimal import Decimal

from django.db import transaction

from outbox_relay.integrations.django import enqueue

from .models import Order


class PaymentDeclined(Exception):
    pass


def place_order(customer: str, total: Decimal, *, decline: bool = False) -> Order:
    with transaction.atomic():
        order = Order.objects.create(customer=customer, total=total)
        enqueue(
            aggregate_type="order",
            aggregate_id=order.pk,
            event_type="order.created",
            payload={"id": order.pk, "customer": customer, "total": str(total)},
            operation_key=f"order-created-{order.pk}",
        )
        if decline:
            # Anything that fails after enqueue takes the event back with the order.
            raise PaymentDeclined(customer)
    return order
