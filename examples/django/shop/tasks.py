"""The shop's actors (``manage.py rundramatiq`` finds every app's ``tasks`` module)."""

import dramatiq
from django.utils import timezone

from .models import Order


@dramatiq.actor(queue_name="shop", max_retries=3)
def send_receipt(order_id: int) -> None:
    """Mark the order's receipt as sent. The order is always there: the job was committed
    with it, in the same transaction."""
    order = Order.objects.get(pk=order_id)
    if order.receipt_sent_at is None:
        order.receipt_sent_at = timezone.now()
        order.save(update_fields=["receipt_sent_at"])
