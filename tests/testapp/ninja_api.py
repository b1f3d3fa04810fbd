"""A Django Ninja API guarded by ``django_idempotency.ninja`` (``tests/request/test_ninja.py``):
each operation's effect is a widget, so counting widgets counts runs."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI, Router, Schema
from ninja.errors import HttpError
from ninja.security import APIKeyHeader, HttpBearer

from django_idempotency.ninja import idempotent
from tests.testapp.models import Widget


class UserBearer(HttpBearer):
    """``Authorization: Bearer <username>``: the user by that name."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        return get_user_model().objects.filter(username=token).first()


class PartnerKey(APIKeyHeader):
    """``X-API-Key: <key>``: the key itself, as many API-key schemes return it."""

    param_name = "X-API-Key"

    def authenticate(self, request: HttpRequest, key: str | None) -> str | None:
        return key if key and key.startswith("pk_") else None


class WidgetIn(Schema):
    name: str
    fail: bool = False


class WidgetOut(Schema):
    id: int
    name: str
    created_by: str


api = NinjaAPI(urls_namespace="idempotency-ninja-tests", title="Ninja tests")
router = Router()


@api.post("/widgets", response={201: WidgetOut})
@idempotent
def create_widget(request: HttpRequest, payload: WidgetIn) -> Any:
    if payload.fail:
        Widget.objects.create(name=payload.name)
        raise HttpError(503, "the widget service is down")
    widget = Widget.objects.create(name=payload.name)
    return widget


@api.post("/async-widgets", response={201: WidgetOut})
@idempotent
async def create_widget_async(request: HttpRequest, payload: WidgetIn) -> Any:
    if payload.fail:
        await Widget.objects.acreate(name=payload.name)
        raise HttpError(503, "the widget service is down")
    widget = await Widget.objects.acreate(name=payload.name)
    return widget


@api.post("/my-widgets", response={201: WidgetOut}, auth=UserBearer())
@idempotent
def create_my_widget(request: HttpRequest, payload: WidgetIn) -> Any:
    user = request.auth  # type: ignore[attr-defined]
    return Widget.objects.create(name=payload.name, created_by=user.username)


@api.post("/partner-widgets", response={201: WidgetOut}, auth=PartnerKey())
@idempotent
async def create_partner_widget(request: HttpRequest, payload: WidgetIn) -> Any:
    return await Widget.objects.acreate(name=payload.name, created_by="partner")


@api.patch("/widgets/{widget_id}", response=WidgetOut)
@idempotent
def rename_widget(request: HttpRequest, widget_id: int, payload: WidgetIn, response: HttpResponse):
    widget = Widget.objects.get(pk=widget_id)
    widget.name = payload.name
    widget.save()
    response["X-Widget-Id"] = str(widget.pk)
    return widget


@router.post("/widgets", response={201: WidgetOut})
@idempotent
def create_routed_widget(request: HttpRequest, payload: WidgetIn) -> Any:
    return Widget.objects.create(name=payload.name, created_by="router")


api.add_router("/routed", router)
