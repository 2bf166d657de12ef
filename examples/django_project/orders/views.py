import json
from decimal import Decimal

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .services import place_order


@csrf_exempt  # an example JSON API; use your project's authentication
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    order = place_order(body["customer"], Decimal(str(body["total"])))
    return JsonResponse({"id": order.pk}, status=201)
