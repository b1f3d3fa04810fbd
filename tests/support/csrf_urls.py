"""Function views with ``@csrf_exempt`` on either side of ``@idempotent``, and one without it,
for ``tests/request/test_decorators_csrf.py``."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.request.decorators import idempotent
from tests.testapp.models import Widget


def create_widget(request: HttpRequest) -> HttpResponse:
    widget = Widget.objects.create(name=json.loads(request.body)["name"])
    return JsonResponse({"id": widget.pk}, status=201)


@csrf_exempt
@idempotent
def exempt_above(request: HttpRequest) -> HttpResponse:
    return create_widget(request)


@idempotent
@csrf_exempt
def exempt_below(request: HttpRequest) -> HttpResponse:
    return create_widget(request)


@idempotent
def not_exempt(request: HttpRequest) -> HttpResponse:
    return create_widget(request)


urlpatterns = [
    path("exempt-above/", exempt_above),
    path("exempt-below/", exempt_below),
    path("not-exempt/", not_exempt),
]
