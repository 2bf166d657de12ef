from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=200)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)
