"""A charge made through ``@idempotent_function``, from every door: called directly (sync and
async), from the views of ``tests/testapp/doors.py`` (``{"charge": <order>}`` in the body), and
from a handed-off worker (:func:`charging_worker`, behind :func:`hand_off_charge`).

Each charge writes a widget named ``charge-<order>``: what a test counts to tell a charge that
committed from one that a cache only remembers. ``mode`` says how the call ends:

``commit``
    return the charge (the default);
``raise``
    raise :class:`Declined` after writing;
``rollback``
    ``transaction.set_rollback(True)`` and return ``{"declined": true}``;
``integrity``
    hit a unique constraint without a savepoint, catch the ``IntegrityError``, return
    ``{"duplicate": true}``;
``*_once``
    that on the first run of an order, ``commit`` on later ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from django_idempotency.request.decorators import idempotent, idempotent_function
from django_idempotency.request.handoff import hand_off, handed_off
from tests.testapp.models import Widget

#: The topic :func:`hand_off_charge` hands its work to.
TOPIC = "tests.charge"
#: How many times each order's charge ran (its own code, replays not counted).
runs: Counter[str] = Counter()
#: How many times each order's handed-off work ran.
worker_runs: Counter[str] = Counter()


class Declined(Exception):
    """A call that fails after writing."""


def _order_only(order: str, mode: str = "commit") -> str:
    return order


def end(mode: str, ran: int, widget: Widget) -> dict[str, Any]:
    """Finish a call that wrote ``widget`` as ``mode`` says (on the ``ran``-th run)."""
    if mode.endswith("_once"):
        mode = mode.removesuffix("_once") if ran == 1 else "commit"
    if mode == "raise":
        raise Declined("the call failed after writing")
    if mode == "rollback":
        transaction.set_rollback(True)
        return {"declined": True}
    if mode == "integrity":
        try:
            Widget.objects.create(pk=widget.pk, name="duplicate")
        except IntegrityError:
            return {"duplicate": True}
    return {"charge": widget.pk}


@idempotent_function(key="order", fingerprint=_order_only)
def charge(order: str, mode: str = "commit") -> dict[str, Any]:
    runs[order] += 1
    widget = Widget.objects.create(name=f"charge-{order}", created_by="charge")
    return end(mode, runs[order], widget)


@idempotent_function(key="order", fingerprint=_order_only)
async def acharge(order: str, mode: str = "commit") -> dict[str, Any]:
    runs[order] += 1
    widget = await sync_to_async(Widget.objects.create)(name=f"charge-{order}", created_by="charge")
    return await sync_to_async(end)(mode, runs[order], widget)


def charged(order: str) -> int:
    """How many charges of ``order`` committed."""
    return Widget.objects.filter(name=f"charge-{order}").count()


@handed_off
def charging_worker(order: str, mode: str = "commit") -> HttpResponse:
    """Handed-off work that charges, then ends as ``mode`` says (``*_once``: on its first run)."""
    worker_runs[order] += 1
    result = charge(order)
    if mode.endswith("_once"):
        mode = mode.removesuffix("_once") if worker_runs[order] == 1 else "commit"
    if mode == "raise":
        raise Declined("the worker failed after charging")
    if mode == "rollback":
        transaction.set_rollback(True)
        return JsonResponse({"error": "declined"}, status=409)
    if mode == "integrity":
        try:
            Widget.objects.create(pk=result["charge"], name="duplicate")
        except IntegrityError:
            return JsonResponse({"error": "duplicate"}, status=409)
    return JsonResponse({"charge": result}, status=201)


@idempotent(long_running=True)
def hand_off_charge(request: HttpRequest) -> HttpResponse:
    import json

    data = json.loads(request.body or b"{}")
    return hand_off(
        request, TOPIC, status_url="/status/", order=str(data["order"]), mode=str(data["mode"])
    )
