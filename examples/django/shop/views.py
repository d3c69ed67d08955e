"""``POST /orders/`` saves an order and sends its receipt job in one atomic block."""

from django.db import transaction
from django.http import JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET, require_POST

from .models import Order
from .tasks import send_receipt

#: The most items one order may hold.
MAX_QUANTITY = 10


class Refused(Exception):
    """An order the shop refuses after it was written: the rollback takes its job too."""


@require_POST
def create_order(request):
    item = request.POST.get("item", "").strip()
    try:
        quantity = int(request.POST.get("quantity", "1"))
    except ValueError:
        return JsonResponse({"error": "quantity must be a whole number"}, status=400)
    if not item or quantity < 1:
        return JsonResponse(
            {"error": "an order needs an item and a quantity of 1 or more"}, status=400
        )
    try:
        with transaction.atomic():
            order = Order.objects.create(item=item, quantity=quantity)
            # Written on Django's connection, inside this block: the worker can only see
            # the job once the order is committed with it.
            message = send_receipt.send(order.pk)
            if quantity > MAX_QUANTITY:
                # Refused after the send: the order and its job roll back together.
                raise Refused(f"at most {MAX_QUANTITY} items an order")
    except Refused as e:
        return JsonResponse({"error": str(e)}, status=409)
    return JsonResponse({"order": order.pk, "job": message.message_id}, status=201)


@require_GET
def show_order(request, pk: int):
    order = get_object_or_404(Order, pk=pk)
    sent = order.receipt_sent_at.isoformat() if order.receipt_sent_at else None
    return JsonResponse({"order": order.pk, "item": order.item, "receipt_sent_at": sent})
