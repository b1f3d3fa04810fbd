"""The payments endpoint and the lightest create endpoint in every variant, plus a bare GET, a
bare POST and the floors.

The bare GET (no database, no DRF) is the ceiling for a replay: the fastest answer this server
gives to anything. The bare POST answers a note replay's request (same headers, same body) with a
note's answer and does nothing else: what that request costs before any idempotency work. Both
run outside a transaction (the settings have ``ATOMIC_REQUESTS``), as a replay's answer does.

The floors are what any idempotency layer must do at the least, done with no layer's code: a
bare POST that first reads the request key's stored answer from Redis (a replay from Redis), one
that first reads it from PostgreSQL (a replay from the database), the plain note create with a
claim committed before it and completed inside its transaction (a first-time key with that
guarantee), and that create after one Redis GET, a miss (a first-time key for a layer that keeps
its answers in Redis). What the replay floors read, and how cheaply, is in ``floors``. No layer
can beat its floor on the same machine; what separates a layer from it is the layer's own work.
Every floor reads its key from ``request.META``, the cheapest place there is.

The DRF floors are the two replay floors for a layer inside DRF's view (a mixin): the key's
scope is the caller, and the caller is known only once DRF has built its request and run its
authentication, so any such layer pays for those before its read. Each is a DRF view that
authenticates (and checks nothing else: no permission, throttle or content negotiation, which a
replay needs no more than the read does), then reads as the plain floor does.
"""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from rest_framework import generics, mixins, viewsets
from rest_framework.request import Request
from rest_framework.views import APIView

from benchmarks.benchproject import floors
from benchmarks.benchproject.notes.models import Note
from benchmarks.benchproject.notes.serializers import NoteSerializer
from demo_project.payments import services
from demo_project.payments.models import Payment
from demo_project.payments.serializers import PaymentSerializer
from django_idempotency.conf import DEFAULTS

# The demo publishes payment.completed through the outbox, which needs our app and its
# IDEMPOTENCY["OUTBOX_PUBLISHERS"]; drf-idempotency reads a setting of the same name and refuses
# keys it does not know. So no variant publishes the event: the business work stays identical on
# every row, and the rows compare the idempotency layers alone.
services.publish = lambda *args, **kwargs: None


class PlainPaymentViewSet(mixins.CreateModelMixin, viewsets.GenericViewSet[Payment]):
    """The demo's payment POST without any idempotency."""

    queryset = Payment.objects.all()
    serializer_class = PaymentSerializer


class PlainNoteView(generics.CreateAPIView[Note]):
    """The lightest DRF create: a three-field model, JSON in and out, one INSERT."""

    queryset = Note.objects.all()
    serializer_class = NoteSerializer


View = TypeVar("View", bound=type)


def guarded(view: View) -> View:
    """``view`` as this variant guards it (middleware variants, ours-middleware included, guard
    it from outside)."""
    if settings.VARIANT in ("ours", "ours-redis", "ours-memory"):
        from django_idempotency.drf import IdempotencyMixin

        # Every client sends credentials (run.AUTHORIZATION): its keys are scoped by them, and
        # a replay is answered before DRF's authentication, as a user serving API clients sets.
        attributes = {"idempotency_scope_by_credentials": True}
        return type(f"Ours{view.__name__}", (IdempotencyMixin, view), attributes)  # type: ignore[return-value]
    if settings.VARIANT == "drfik":
        from drf_idempotencykey.mixins import DrfIdempotencyKeyMixin

        return type(f"Drfik{view.__name__}", (DrfIdempotencyKeyMixin, view), {})  # type: ignore[return-value]
    return view


@transaction.non_atomic_requests
def bare_get(request: HttpRequest) -> HttpResponse:
    """A small JSON answer without the database or DRF: the replay ceiling."""
    return HttpResponse(b'{"ok":true}', content_type="application/json")


NOTE_ANSWER = b'{"id":1,"title":"bench","body":"a note","done":false}'


@transaction.non_atomic_requests
def bare_post(request: HttpRequest) -> HttpResponse:
    """A note's answer to a note replay's request, without reading it, the database or DRF."""
    return HttpResponse(NOTE_ANSWER, status=201, content_type="application/json")


# --- floors ------------------------------------------------------------------------------------


def missing(key: str) -> HttpResponse:
    """A floor that finds no stored answer fails: its row would otherwise pass for fast."""
    return HttpResponse(f"no stored answer for {key}".encode(), status=500)


def another_body(key: str) -> HttpResponse:
    """A retry whose body differs from the stored request's is refused, as a layer must."""
    return HttpResponse(f"{key} was used with another body".encode(), status=422)


@transaction.non_atomic_requests
def floor_redis(request: HttpRequest) -> HttpResponse:
    """The bare POST after one Redis GET of the key's stored answer under the credentials'
    scope and a check of the body's fingerprint, on a connection kept for good, outside a
    transaction (a replay opens none): the fastest a replay kept in Redis can be answered."""
    return _replay_from_redis(request, floors.credentials_scope(request))


def _replay_from_redis(request: HttpRequest, scope: str) -> HttpResponse:
    key = request.META["HTTP_IDEMPOTENCY_KEY"]
    stored = floors.redis_client().get(floors.redis_key(scope, key))
    if stored is None:
        return missing(key)
    if stored[: floors.FINGERPRINT_BYTES] != floors.fingerprint(request.body):
        return another_body(key)
    return bare_post(request)


@transaction.non_atomic_requests
def floor_database(request: HttpRequest) -> HttpResponse:
    """The bare POST after one prepared read of the key's stored answer by scope (the
    credentials') and key and a check of the body's fingerprint, outside a transaction (as a
    replay's read is): the fastest a replay kept in PostgreSQL can be answered. ``Bench-Check``
    in the request: says whether the read is prepared."""
    return _replay_from_database(request, floors.credentials_scope(request))


def _replay_from_database(request: HttpRequest, scope: str) -> HttpResponse:
    key = request.META["HTTP_IDEMPOTENCY_KEY"]
    record = floors.read_record(scope, key)
    if record is None:
        return missing(key)
    if record[1] != floors.fingerprint(request.body):
        return another_body(key)
    response = bare_post(request)
    if "HTTP_BENCH_CHECK" in request.META:
        response["Bench-Prepared"] = str(floors.prepared()).lower()
    return response


class DrfFloor(APIView):
    """DRF's request and its authentication, and nothing else DRF would check, before a read
    made outside a transaction (a replay opens none), under the authenticated user's scope."""

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        return transaction.non_atomic_requests(super().as_view(**initkwargs))

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self.perform_authentication(request)


class DrfFloorRedis(DrfFloor):
    """The Redis floor inside DRF: the caller authenticated, then one Redis GET."""

    def post(self, request: Request) -> HttpResponse:
        return _replay_from_redis(request._request, floors.user_scope(request.user))


class DrfFloorDatabase(DrfFloor):
    """The database floor inside DRF: the caller authenticated, then one prepared read."""

    def post(self, request: Request) -> HttpResponse:
        return _replay_from_database(request._request, floors.user_scope(request.user))


_LEASE, _TTL = DEFAULTS["LEASE_SECONDS"], DEFAULTS["TTL_SECONDS"]
#: The claim: a new key's row under its scope with its request's fingerprint and its owner, a
#: lease of the library's default ``LEASE_SECONDS`` and an expiry its ``TTL_SECONDS`` after
#: that, committed on its own before the view, without waiting for its WAL flush (the business
#: commit after it flushes it).
FLOOR_CLAIM = (
    "INSERT INTO bench_notes_floorclaim "
    "(scope, key, fingerprint, owner, lease_expires_at, expires_at) "
    f"SELECT %s, %s, %s, %s, statement_timestamp() + interval '{_LEASE} seconds', "
    f"statement_timestamp() + interval '{_LEASE + _TTL} seconds' "
    "WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL RETURNING id"
)
#: The completion, inside the business transaction and fenced by the owner (a request whose
#: key was taken over must not store its answer): the answer a retry gets. It changes no
#: indexed column, so PostgreSQL can update the row in place.
FLOOR_COMPLETE = (
    "UPDATE bench_notes_floorclaim SET status = %s, body = %s WHERE id = %s AND owner = %s"
)


class FloorNoteView(PlainNoteView):
    """The plain note create with a claim committed before it and completed in its transaction
    (the answer stored with the note): two more statements and one more commit, with no
    idempotency layer's code. The fastest a first-time key can be served with that guarantee (a
    claim that holds the key before the view runs, its answer stored with the business data or
    not at all). The claim holds the key under the credentials' scope with the body's
    fingerprint, which a retry is compared with."""

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        return transaction.non_atomic_requests(super().as_view(**initkwargs))

    def look_up(self, scope: str, key: str) -> None:
        """Where a layer looks for a stored answer before it claims: nowhere, here."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        # Both statements prepared on the server, as a layer's own statements are.
        scope, key = floors.credentials_scope(request), request.META["HTTP_IDEMPOTENCY_KEY"]
        self.look_up(scope, key)
        owner = uuid.uuid4()
        claimed = (scope, key, floors.fingerprint(request.body), owner)
        (claim,) = floors.execute(FLOOR_CLAIM, claimed).fetchone()
        with transaction.atomic():
            response = super().dispatch(request, *args, **kwargs)
            response.render()  # type: ignore[attr-defined]
            completed = (response.status_code, response.content, claim, owner)
            if floors.execute(FLOOR_COMPLETE, completed).rowcount != 1:
                raise RuntimeError(f"the floor's claim of {key} was taken over")
        return response


class FloorNoteRedisView(FloorNoteView):
    """The first-time floor after one Redis GET of the key, a miss (a new key has no stored
    answer), on a kept connection: what a layer that answers replays from Redis adds to a
    first-time key at the least, since it must look there first."""

    def look_up(self, scope: str, key: str) -> None:
        floors.redis_client().get(floors.redis_key(scope, key))
