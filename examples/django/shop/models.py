from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=200)
    quantity = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    #: Set by the send_receipt job, once the order it reads is committed.
    receipt_sent_at = models.DateTimeField(null=True, blank=True)
