"""``@idempotent_function``: any callable, Celery tasks included, runs once per key and its
return value is stored.

A door into the request lifecycle, like ``@idempotent`` for views: the call becomes an
:class:`~django_idempotency.core.types.Identity` (the key read from its arguments, in the
function's scope, with a digest of its arguments as the fingerprint), claimed by
:func:`lifecycle.claim <django_idempotency.request.lifecycle.claim>` under the same rules, leases
and fencing tokens as a request. The function then runs through the one run step
(:func:`~django_idempotency.request.run_step.run_step`), as a view does: inside one
transaction with the storing of its serialized return value (the record's body, status 200, the
serializer's content type), fenced by the owner token; when it raises, its writes roll back and
the key is released. Only the key, the fingerprint and the serializer are this door's own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload, runtime_checkable
from uuid import UUID

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, models

from django_idempotency.conf import conf
from django_idempotency.core.types import (
    MAX_KEY_LENGTH,
    MAX_SCOPE_LENGTH,
    Conflict,
    Identity,
    Lease,
    Mismatch,
    StoredResponse,
)
from django_idempotency.exceptions import (
    IdempotentCallInProgress,
    IdempotentCallKeyInvalid,
    IdempotentCallMismatch,
    IdempotentFunctionError,
    IdempotentResultNotStorable,
    LeaseLost,
)
from django_idempotency.request import lifecycle
from django_idempotency.request.run_step import Keep, run_step

__all__ = [
    "CALL_METHOD",
    "JSONSerializer",
    "RESULT_CONTENT_TYPE",
    "RESULT_STATUS",
    "Serializer",
    "idempotent_function",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The record's ``method`` for a function call (its ``path`` is the function's dotted name).
CALL_METHOD = "CALL"
#: The record's response status for a stored return value.
RESULT_STATUS = 200
#: The default serializer's content type, stored with the value: it marks a function's result.
RESULT_CONTENT_TYPE = "application/vnd.django-idempotency.result+json"

#: Parameters left out of the default fingerprint: a bound Celery task's ``self``, a method's
#: instance or class.
_UNCOMPARED = frozenset({"self", "cls"})


@runtime_checkable
class Serializer(Protocol):
    """How a return value is stored and read back: ``serializer=`` takes any object with these.

    ``dumps`` raises ``TypeError`` or ``ValueError`` for a value it cannot store.
    """

    #: Stored with the value (the record's ``Content-Type``).
    content_type: str

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JSONSerializer:
    """JSON through Django's ``DjangoJSONEncoder``: dates, times, decimals and UUIDs are stored as
    strings and read back as strings; NaN and infinities are refused."""

    content_type = RESULT_CONTENT_TYPE

    def dumps(self, value: Any) -> bytes:
        return json.dumps(
            value, cls=DjangoJSONEncoder, separators=(",", ":"), allow_nan=False
        ).encode()

    def loads(self, data: bytes) -> Any:
        return json.loads(data)


class _FingerprintEncoder(DjangoJSONEncoder):
    """Canonical arguments: Django's types, a model instance as its model and primary key, a
    dataclass instance as its fields."""

    def default(self, o: Any) -> Any:
        if isinstance(o, models.Model):
            return {"model": o._meta.label_lower, "pk": o.pk}
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {"dataclass": type(o).__qualname__, **dataclasses.asdict(o)}
        if isinstance(o, set | frozenset):
            return sorted(self.encode(item) for item in o)
        return super().default(o)


# --- the key ----------------------------------------------------------------------------------

#: A call's key from its bound arguments (defaults applied) and, for a key callable, the
#: arguments as the caller passed them.
KeyReader = Callable[[inspect.BoundArguments, tuple[Any, ...], dict[str, Any]], str]


def _key_reader(name: str, signature: inspect.Signature, key: Any) -> KeyReader:
    """What turns a call's bound arguments into its key; a path that can never work is refused
    here, at decoration time."""
    if callable(key):

        def from_callable(
            bound: inspect.BoundArguments, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> str:
            return _key_text(name, "the key callable", key(*args, **kwargs))

        return from_callable
    if not isinstance(key, str):
        raise TypeError(
            f"@idempotent_function on {name}: key must be a dotted path into the arguments "
            f"(a str such as 'order.id') or a callable taking the function's arguments, "
            f"not {type(key).__name__}."
        )
    segments = key.split(".")
    if not all(segment.strip() == segment and segment for segment in segments):
        raise TypeError(
            f"@idempotent_function on {name}: key={key!r} is not a dotted path such as "
            f"'order.id' or 'payload.order_id'."
        )
    parameters = signature.parameters
    first = segments[0]
    var_keyword = next(
        (p.name for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    if first not in parameters and var_keyword is None:
        raise TypeError(
            f"@idempotent_function on {name}: key={key!r} starts with {first!r}, which is not "
            f"a parameter of {name}{signature}. The first part of the path names a parameter."
        )

    def from_path(
        bound: inspect.BoundArguments, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        arguments = bound.arguments
        if first in parameters:
            value = arguments[first]
        else:  # a keyword argument gathered by **kwargs
            assert var_keyword is not None
            extra = arguments.get(var_keyword, {})
            if first not in extra:
                raise IdempotentCallKeyInvalid(
                    f"{name}: key={key!r} needs a keyword argument {first!r}; this call has "
                    f"{sorted(extra)}."
                )
            value = extra[first]
        walked = [first]
        for segment in segments[1:]:
            value = _step(name, key, ".".join(walked), value, segment)
            walked.append(segment)
        return _key_text(name, f"key={key!r}", value)

    return from_path


def _step(name: str, key: str, walked: str, value: Any, segment: str) -> Any:
    """One segment of a key path: an item of a mapping (or a sequence, by index), else an
    attribute."""
    try:
        if isinstance(value, Mapping):
            return value[segment]
        if segment.isdigit() and isinstance(value, Sequence) and not isinstance(value, str | bytes):
            return value[int(segment)]
        return getattr(value, segment)
    except (KeyError, IndexError, AttributeError) as exc:
        raise IdempotentCallKeyInvalid(
            f"{name}: key={key!r}: {walked} (a {type(value).__name__}) has no "
            f"{'item' if isinstance(value, Mapping | Sequence) else 'attribute'} {segment!r}."
        ) from exc


def _key_text(name: str, source: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | UUID):
        raise IdempotentCallKeyInvalid(
            f"{name}: {source} gave {type(value).__name__} {value!r:.60}; a key must be a "
            f"str, an int or a UUID. Give key= a callable that returns one."
        )
    text = str(value)
    if not text or len(text) > MAX_KEY_LENGTH or "\x00" in text:
        raise IdempotentCallKeyInvalid(
            f"{name}: {source} gave {text!r:.60}; a key must be 1 to {MAX_KEY_LENGTH} "
            f"characters without NUL. Hash a longer one in a key= callable."
        )
    return text


# --- the fingerprint --------------------------------------------------------------------------

Fingerprint = Callable[..., Any] | None


def _fingerprint_reader(
    name: str, fingerprint: Fingerprint | _Default
) -> Callable[[inspect.BoundArguments, tuple[Any, ...], dict[str, Any]], str]:
    def read(bound: inspect.BoundArguments, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if fingerprint is None:
            compared: Any = None
        elif isinstance(fingerprint, _Default):
            compared = {
                param: value for param, value in bound.arguments.items() if param not in _UNCOMPARED
            }
        else:
            compared = fingerprint(*args, **kwargs)
        try:
            canonical = json.dumps(
                compared, cls=_FingerprintEncoder, sort_keys=True, separators=(",", ":")
            )
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name}: its arguments must be JSON-serializable (with Django's encoder; model "
                f"instances count by primary key) to be compared with an earlier call's: {exc}. "
                f"Pass fingerprint= a callable returning what identifies the call, or "
                f"fingerprint=None to not compare arguments."
            ) from exc
        return hashlib.sha256(canonical.encode()).hexdigest()

    return read


class _Default:
    """The default fingerprint: every argument but ``self`` and ``cls``."""


_DEFAULT = _Default()


# --- the decorator ----------------------------------------------------------------------------


@overload
def idempotent_function(
    *,
    key: str | Callable[..., Any],
    scope: str | None = ...,
    ttl: float | None = ...,
    lease: float | None = ...,
    serializer: Serializer | None = ...,
    using: str | Sequence[str] | None = ...,
    fingerprint: Fingerprint | _Default = ...,
    heartbeat: bool | None = ...,
) -> Callable[[F], F]: ...


@overload
def idempotent_function(func: F, /, *, key: str | Callable[..., Any]) -> F: ...


def idempotent_function(
    func: Callable[..., Any] | None = None,
    /,
    *,
    key: str | Callable[..., Any],
    scope: str | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    serializer: Serializer | None = None,
    using: str | Sequence[str] | None = None,
    fingerprint: Fingerprint | _Default = _DEFAULT,
    heartbeat: bool | None = None,
) -> Any:
    """Run the function once per key; a repeat returns the stored return value without running.

    ``key``: a dotted path into the arguments (``"order.id"``, ``"payload.order_id"``: a
    parameter's name, then attribute or item lookups, a digit indexing a list), or a callable
    taking the same arguments as the function and returning a ``str``, ``int`` or ``UUID``.

    ``scope``: the namespace of the keys (default ``function:<module>.<qualified name>``, so two
    functions never share keys). ``ttl`` and ``lease``: seconds, default ``TTL_SECONDS`` and
    ``LEASE_SECONDS``. ``serializer``: a :class:`Serializer`, default :class:`JSONSerializer`.
    ``using``: the database(s) the function writes to (default ``"default"``); each runs in a
    transaction that commits with the stored value. ``fingerprint``: what a repeat must match
    (default: every argument but ``self`` and ``cls``; a callable with the function's arguments;
    ``None`` for no comparison). ``heartbeat``: extend the lease while the function runs
    (default ``LEASE_HEARTBEAT``).

    Every call returns what a replay returns: the value after a round trip through the
    serializer. Raises :class:`~django_idempotency.exceptions.IdempotentCallInProgress` while
    another call holds the key, :class:`~django_idempotency.exceptions.IdempotentCallMismatch`
    for a key used with other arguments, :class:`~django_idempotency.exceptions.LeaseLost` when
    another call took the key over (this call's writes rolled back), and whatever the function
    raised, after releasing the key.
    """
    for option, seconds in (("ttl", ttl), ("lease", lease)):
        if seconds is not None and (isinstance(seconds, bool) or not seconds > 0):
            raise ValueError(
                f"@idempotent_function: {option} must be a positive number of seconds."
            )
    if serializer is not None and not isinstance(serializer, Serializer):
        raise TypeError(
            "@idempotent_function: serializer must have content_type, dumps(value) -> bytes and "
            "loads(bytes)."
        )
    aliases = [using] if isinstance(using, str) else list(using or [DEFAULT_DB_ALIAS])

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        guarded = _Guarded(
            function,
            key=key,
            scope=scope,
            ttl=ttl,
            lease=lease,
            serializer=serializer or JSONSerializer(),
            aliases=aliases,
            fingerprint=fingerprint,
            heartbeat=heartbeat,
        )
        if iscoroutinefunction(function):

            @functools.wraps(function)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                # The transaction must live in one thread: the whole call runs in the thread
                # Django's async ORM uses, and the coroutine inside it, as for async views.
                call = async_to_sync(functools.partial(function, *args, **kwargs))
                return await sync_to_async(guarded, thread_sensitive=True)(args, kwargs, call)

            return async_wrapper

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return guarded(args, kwargs, functools.partial(function, *args, **kwargs))

        return wrapper

    return decorate(func) if func is not None else decorate


class _Guarded:
    """One decorated function: reads a call's identity, claims it, runs or replays."""

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        key: str | Callable[..., Any],
        scope: str | None,
        ttl: float | None,
        lease: float | None,
        serializer: Serializer,
        aliases: list[str],
        fingerprint: Fingerprint | _Default,
        heartbeat: bool | None,
    ) -> None:
        self.name = f"{function.__module__}.{function.__qualname__}"
        self.signature = inspect.signature(function)
        self.read_key = _key_reader(self.name, self.signature, key)
        self.read_fingerprint = _fingerprint_reader(self.name, fingerprint)
        scope = scope if scope is not None else f"function:{self.name}"
        if len(scope) > MAX_SCOPE_LENGTH:
            scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
        self.scope = scope
        self.ttl = ttl
        self.lease = lease
        self.serializer = serializer
        self.aliases = aliases
        self.heartbeat = heartbeat

    def __call__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[[], Any]
    ) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        identity = Identity(
            scope=self.scope,
            key=self.read_key(bound, args, kwargs),
            fingerprint=self.read_fingerprint(bound, args, kwargs),
            method=CALL_METHOD,
            path=self.name,
        )
        decision = lifecycle.claim(identity, lease_seconds=self.lease, ttl_seconds=self.ttl)
        return lifecycle.settle(decision, _Call(self, identity, call))

    def run(self, lease: Lease, call: Callable[[], Any]) -> Any:
        """Call the function through the run step: its value stored with its
        writes, or (raised, rolled back) nothing stored and the key released."""
        try:
            ran = run_step(lease, call, self.keep, also=self.aliases, heartbeat=self.heartbeat)
        except LeaseLost as exc:
            raise LeaseLost(
                f"{self.name}: this call ran past its lease and another call with key "
                f"{lease.identity.key!r} took it over; this call's writes were rolled back. "
                f"Call again to get the other call's result."
            ) from exc
        if ran.kept is None:
            # The function caught a database error or asked for a rollback: nothing of it
            # committed, so nothing is stored and a later call runs again (as for a view).
            return ran.value
        return self.load(ran.kept.stored)

    def keep(self, value: Any) -> Keep:
        return Keep(self.dump(value))

    def dump(self, value: Any) -> StoredResponse:
        try:
            body = self.serializer.dumps(value)
        except (TypeError, ValueError) as exc:
            raise IdempotentResultNotStorable(
                f"{self.name} returned a value its serializer cannot store ({exc}); its writes "
                f"were rolled back and the key released. Return something the serializer "
                f"takes (JSON by default), or pass serializer=."
            ) from exc
        if len(body) > conf.MAX_RESPONSE_BYTES:
            raise IdempotentResultNotStorable(
                f"{self.name} returned {len(body)} bytes once serialized, more than "
                f"IDEMPOTENCY['MAX_RESPONSE_BYTES'] ({conf.MAX_RESPONSE_BYTES}); its writes "
                f"were rolled back and the key released. Return less (an id), or raise the "
                f"setting."
            )
        headers = [("Content-Type", self.serializer.content_type)]
        return StoredResponse(RESULT_STATUS, headers, body)

    def load(self, stored: StoredResponse) -> Any:
        if stored.status != RESULT_STATUS or not stored.retained:
            raise IdempotentFunctionError(
                f"{self.name}: the record under this key holds no function result (status "
                f"{stored.status}); was scope= shared with a view?"
            )
        return self.serializer.loads(stored.body)


@dataclass(frozen=True, slots=True)
class _Call:
    """One call's answer to each outcome of its claim (``lifecycle.Door``)."""

    guarded: _Guarded
    identity: Identity
    call: Callable[[], Any]

    def unkeyed(self) -> Any:  # pragma: no cover - a call always has its key
        raise AssertionError("a function call always has a key")

    def replay(self, stored: StoredResponse) -> Any:
        return self.guarded.load(stored)

    def refuse(self, decision: Conflict | Mismatch) -> Any:
        name, key = self.guarded.name, self.identity.key
        if isinstance(decision, Conflict):
            raise IdempotentCallInProgress(
                decision.retry_after,
                f"{name}: a call with key {key!r} is still running; call again in "
                f"{decision.retry_after} s to get its result.",
            )
        raise IdempotentCallMismatch(
            f"{name}: key {key!r} was already used by a call with different arguments; "
            f"nothing ran. Use a new key for a new call."
        )

    def proceed(self, lease: Lease) -> Any:
        return self.guarded.run(lease, self.call)
