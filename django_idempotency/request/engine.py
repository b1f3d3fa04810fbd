"""The request state machine: claim, run, complete or release. Framework-free (no DRF import).

The claim is its own short statement in autocommit, committed before the view's transaction
opens, so a concurrent duplicate sees the PROCESSING record at once and never waits on the first
request's business transaction. Completion is one UPDATE inside the business transaction, fenced
by the owner token: a request that lost its lease to a takeover updates nothing, raises
:class:`LeaseLost`, and its business writes roll back with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from django.db import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.models import Field
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.exceptions import (
    IdempotencyHTTPError,
    IdempotencyKeyMissing,
    LeaseLost,
    LeaseLostConflict,
    PayloadMismatch,
    StoreUnavailable,
    TransactionInProgress,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.querysets import COMPLETED, PROCESSING, expired_q, lease_expired_q
from django_idempotency.request import fastpath
from django_idempotency.request.fingerprint import (
    hand_over_cleanup,
    recorded_path,
    request_fingerprint,
)
from django_idempotency.request.instrumentation import instrumented
from django_idempotency.request.keys import parse_key, redact
from django_idempotency.request.responses import (
    StoredResponse,
    capture,
    headers_as_json,
    headers_from_json,
    problem_response,
)
from django_idempotency.request.responses import replay as replay_response

logger = logging.getLogger(__name__)

#: Database errors that mean "the database is not there", answered 503 rather than 500.
UNAVAILABLE_ERRORS = (OperationalError, InterfaceError)

ViewT = TypeVar("ViewT", bound=Callable[..., Any])

_MAX_SCOPE_LENGTH = 255
_CLAIM_ROUNDS = 5


@dataclass(frozen=True, slots=True)
class Identity:
    """What a claim is about: the key in its scope, and the request it must keep meaning."""

    scope: str
    key: str
    fingerprint: str
    method: str
    path: str


@dataclass(frozen=True, slots=True)
class Lease:
    """A successful claim: this request owns the key until ``expires_at``."""

    identity: Identity
    owner_token: uuid.UUID
    expires_at: datetime
    attempt: int
    using: str

    @property
    def taken_over(self) -> bool:
        return self.attempt > 1

    def derived_key(self, suffix: str) -> str:
        """A stable key for a downstream call (a vendor's own Idempotency-Key header).

        Every attempt of this request, including a takeover after a crash, derives the same key,
        so the vendor deduplicates what our transaction cannot roll back.
        """
        return f"{self.identity.scope}:{self.identity.key}:{suffix}"


@dataclass(frozen=True, slots=True)
class Proceed:
    lease: Lease


@dataclass(frozen=True, slots=True)
class Replay:
    response: StoredResponse


@dataclass(frozen=True, slots=True)
class Conflict:
    retry_after: int


@dataclass(frozen=True, slots=True)
class Mismatch:
    pass


Decision = Proceed | Replay | Conflict | Mismatch


def read_key(request: HttpRequest) -> str | None:
    """The request's key; ``None`` when it sent none and none is required (400s otherwise)."""
    raw = request.headers.get(conf.HEADER)
    if raw is None:
        if conf.KEY_REQUIRED:
            raise IdempotencyKeyMissing(f"This endpoint requires an {conf.HEADER} header.")
        return None
    return parse_key(raw)


def identify(request: HttpRequest, key: str, *, scope: str, fingerprint: str) -> Identity:
    return Identity(
        scope=scope,
        key=key,
        fingerprint=fingerprint,
        method=request.method or "",
        path=recorded_path(request),
    )


def resolve_scope(request: Any) -> str:
    scope = str(conf.SCOPE_RESOLVER(request))
    if len(scope) > _MAX_SCOPE_LENGTH:
        # Hashing keeps long tenant identifiers distinct where truncating would merge them.
        scope = "sha256:" + hashlib.sha256(scope.encode()).hexdigest()
    return scope


def database_alias() -> str:
    return router.db_for_write(IdempotencyRecord)


def opt_out_of_atomic_requests(view: ViewT) -> ViewT:
    """Stop ATOMIC_REQUESTS from wrapping ``view`` in one transaction.

    The claim must commit before the view's transaction opens; ATOMIC_REQUESTS would put both
    in one transaction and make concurrent duplicates wait for the first request to finish.
    Guarded requests get their own transaction from :func:`run`; other requests get the
    ATOMIC_REQUESTS transactions back from :func:`atomic_requests`.
    """
    view._non_atomic_requests = set(connections)  # type: ignore[attr-defined]
    return view


def atomic_requests() -> ExitStack:
    """The transactions ATOMIC_REQUESTS would have opened, for requests the view does not guard."""
    stack = ExitStack()
    for alias, settings_dict in connections.settings.items():
        if settings_dict.get("ATOMIC_REQUESTS"):
            stack.enter_context(transaction.atomic(using=alias))
    return stack


# --- claim -------------------------------------------------------------------------------------


@instrumented("claim")  # operations: span + claim_finished signal (claim latency metric)
def claim(identity: Identity) -> Decision:
    """Decide what this request may do with its key (see DESIGN.md's state machine).

    Raises :class:`StoreUnavailable` when the database cannot be reached.
    """
    owner_token = uuid.uuid4()
    # Redis fast path hook (fastpath.py): a replay or a concurrent duplicate is answered from
    # Redis without a query; otherwise our in-flight marker is set first, with our owner token.
    answer, marked = fastpath.claim(identity, owner_token)
    if answer is not None:
        _announce(identity, answer)
        return answer
    try:
        decision = _claim_in_database(identity, owner_token)
    except BaseException:
        if marked:
            fastpath.release(identity, owner_token)
        raise
    if marked and not isinstance(decision, Proceed):
        fastpath.release(identity, owner_token)  # the marker stands only for a request that runs
    return decision


def _claim_in_database(identity: Identity, owner_token: uuid.UUID) -> Decision:
    using = database_alias()
    connection = connections[using]
    claim_round = _claim_postgresql if connection.vendor == "postgresql" else _claim_portable
    try:
        for _ in range(_CLAIM_ROUNDS):
            now = timezone.now()
            decision = claim_round(identity, using, now, owner_token)
            if decision is not None:
                _announce(identity, decision)
                return decision
    except UNAVAILABLE_ERRORS as exc:
        logger.warning(
            "idempotency claim failed: database unavailable",
            extra=_log_extra(identity, "store_unavailable"),
            exc_info=exc,
        )
        raise StoreUnavailable() from exc
    # Every round lost a race to another request changing the same record; that request is
    # active right now, so the honest answer is "in progress, try again shortly".
    decision = Conflict(retry_after=1)
    _announce(identity, decision)
    return decision


def _new_record_values(identity: Identity, now: datetime, owner_token: uuid.UUID) -> dict[str, Any]:
    lease_seconds = conf.LEASE_SECONDS
    return {
        "fingerprint": identity.fingerprint,
        "status": PROCESSING,
        "owner_token": owner_token,
        "lease_expires_at": now + timedelta(seconds=lease_seconds),
        "method": identity.method,
        "path": identity.path,
        "created_at": now,
        # A PROCESSING record outlives its lease by the TTL, so the sweep eventually removes a
        # key whose client never came back.
        "expires_at": now + timedelta(seconds=lease_seconds + conf.TTL_SECONDS),
    }


def _decide(record: IdempotencyRecord, identity: Identity, now: datetime) -> Decision | None:
    """The state machine on a record read without a lock; ``None`` means "claim it"."""
    expired = record.expires_at <= now and (
        record.status == COMPLETED
        or (record.lease_expires_at is not None and record.lease_expires_at <= now)
    )
    if expired:
        return None
    if record.fingerprint != identity.fingerprint:
        return Mismatch()
    if record.status == COMPLETED:
        return Replay(_stored(record))
    assert record.lease_expires_at is not None
    if record.lease_expires_at > now:
        seconds = math.ceil((record.lease_expires_at - now).total_seconds())
        return Conflict(retry_after=max(1, seconds))
    return None  # PROCESSING, lease expired, same request: take it over


def _stored(record: IdempotencyRecord) -> StoredResponse:
    body = record.response_body
    return StoredResponse(
        status=record.response_status or 200,
        headers=headers_from_json(record.response_headers),
        body=bytes(body) if body is not None else b"",
        retained=record.response_retained,
    )


def _claim_portable(
    identity: Identity, using: str, now: datetime, owner_token: uuid.UUID
) -> Decision | None:
    """SELECT, then INSERT or a fenced takeover UPDATE. Every statement commits on its own.

    Inside an outer transaction (which defeats the point, but happens in tests and under
    ATOMIC_REQUESTS) the read locks, because MariaDB's REPEATABLE READ snapshot would otherwise
    hide a row another request just committed.
    """
    connection = connections[using]
    records = IdempotencyRecord.objects.using(using).for_key(identity.scope, identity.key)
    if connection.in_atomic_block:
        records = records.select_for_update()
    record = records.first()
    values = _new_record_values(identity, now, owner_token)
    if record is None:
        try:
            with _statement_savepoint(using):
                IdempotencyRecord.objects.using(using).create(
                    scope=identity.scope, key=identity.key, **values
                )
        except IntegrityError:
            return None  # a concurrent request inserted it first: read it again
        return Proceed(_lease(identity, values, attempt=1, using=using))
    decision = _decide(record, identity, now)
    if decision is not None:
        return decision
    takeover = record.status == PROCESSING and record.expires_at > now
    attempt = record.attempts + 1 if takeover else 1
    updated = (
        IdempotencyRecord.objects.using(using)
        .filter(pk=record.pk, owner_token=record.owner_token)
        .filter(expired_q(now) | lease_expired_q(now))
        .update(
            **values,
            attempts=attempt,
            response_status=None,
            response_headers=[],
            response_body=None,
            response_retained=True,
            completed_at=None,
        )
    )
    if updated != 1:
        return None  # someone else took it over or completed it meanwhile: look again
    return Proceed(_lease(identity, values, attempt=attempt, using=using))


def _claim_postgresql(
    identity: Identity, using: str, now: datetime, owner_token: uuid.UUID
) -> Decision | None:
    """One statement for every path: insert, take over, reuse an expired record, or read it.

    ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` locks the conflicting row and re-checks the
    takeover condition on its latest version, so two takeovers can never both succeed. When the
    condition fails, the trailing SELECT returns the row as of the statement's snapshot, which
    is enough to replay, answer 409 or 422. If a concurrent statement committed the row after our
    snapshot began, nothing comes back and the caller simply runs another round.
    """
    values = _new_record_values(identity, now, owner_token)
    sql, params = _postgresql_claim_sql(identity, values, now, using)
    connection = connections[using]
    # A plain cursor rather than .raw(): this runs on every write request, and building the row
    # by hand costs a fraction of RawQuerySet's column resolution.
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
        names = [column.name for column in cursor.description or ()]
    if row is None:
        return None
    *columns, claimed = row
    record = IdempotencyRecord.from_db(using, names[:-1], columns)
    if claimed:
        return Proceed(_lease(identity, values, attempt=record.attempts, using=using))
    if isinstance(record.response_headers, str):  # Django reads jsonb as text for the field
        record.response_headers = json.loads(record.response_headers)
    return _decide(record, identity, now)


def _field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", IdempotencyRecord._meta.get_field(name))


def _postgresql_claim_sql(
    identity: Identity, values: dict[str, Any], now: datetime, using: str
) -> tuple[str, list[Any]]:
    connection = connections[using]
    insert_values = {
        "scope": identity.scope,
        "key": identity.key,
        **values,
        "attempts": 1,
        "response_status": None,
        "response_headers": [],
        "response_body": None,
        "response_retained": True,
        "completed_at": None,
    }
    params: list[Any] = [
        _field(name).get_db_prep_save(value, connection) for name, value in insert_values.items()
    ]
    db_now = _field("expires_at").get_db_prep_save(now, connection)
    params += [
        PROCESSING, db_now,  # attempts CASE (takeover)
        PROCESSING, db_now,  # created_at CASE (takeover)
        db_now, COMPLETED, db_now,  # expired
        PROCESSING, db_now,  # stale
        identity.scope, identity.key,
    ]  # fmt: skip
    return _postgresql_claim_text(using, tuple(insert_values)), params


@functools.lru_cache(maxsize=16)
def _postgresql_claim_text(using: str, names: tuple[str, ...]) -> str:
    """The claim statement; its text depends only on the connection, so it is built once."""
    connection = connections[using]
    quote = connection.ops.quote_name
    table = quote(IdempotencyRecord._meta.db_table)

    def column(name: str) -> str:
        return quote(str(_field(name).column))

    def col(name: str) -> str:
        return f"{table}.{column(name)}"

    def excluded(name: str) -> str:
        return f"EXCLUDED.{column(name)}"

    expired = (
        f"({col('expires_at')} <= %s AND ({col('status')} = %s OR {col('lease_expires_at')} <= %s))"
    )
    stale = (
        f"({col('status')} = %s AND {col('lease_expires_at')} <= %s "
        f"AND {col('fingerprint')} = {excluded('fingerprint')})"
    )
    takeover = f"({col('status')} = %s AND {col('expires_at')} > %s)"
    assignments = [
        f"{column(name)} = {excluded(name)}"
        for name in names
        if name not in ("scope", "key", "attempts", "created_at")
    ]
    assignments.append(
        f"{column('attempts')} = CASE WHEN {takeover} THEN {col('attempts')} + 1 ELSE 1 END"
    )
    assignments.append(
        f"{column('created_at')} = "
        f"CASE WHEN {takeover} THEN {col('created_at')} ELSE {excluded('created_at')} END"
    )
    return (
        f"WITH claimed AS ("
        f"INSERT INTO {table} ({', '.join(column(name) for name in names)}) "
        f"VALUES ({', '.join(['%s'] * len(names))}) "
        f"ON CONFLICT ({column('scope')}, {column('key')}) "
        f"DO UPDATE SET {', '.join(assignments)} "
        f"WHERE {expired} OR {stale} "
        f"RETURNING {table}.*, true AS claimed) "
        f"SELECT * FROM claimed UNION ALL "
        f"SELECT {table}.*, false AS claimed FROM {table} "
        f"WHERE {col('scope')} = %s AND {col('key')} = %s "
        f"AND NOT EXISTS (SELECT 1 FROM claimed)"
    )


def _lease(identity: Identity, values: dict[str, Any], *, attempt: int, using: str) -> Lease:
    return Lease(
        identity=identity,
        owner_token=values["owner_token"],
        expires_at=values["lease_expires_at"],
        attempt=attempt,
        using=using,
    )


@contextmanager
def _statement_savepoint(using: str) -> Iterator[None]:
    """A savepoint only when a transaction is open; in autocommit the statement is atomic."""
    if connections[using].in_atomic_block:
        with transaction.atomic(using=using):
            yield
    else:
        yield


# --- complete, release, extend ---------------------------------------------------------------


@instrumented("complete")  # operations: span
def complete(lease: Lease, stored: StoredResponse) -> None:
    """Store the response, inside the business transaction, if this request still owns the key.

    Raises :class:`LeaseLost` when another request took the key over: the caller must let the
    business transaction roll back.
    """
    now = timezone.now()
    expires_at = now + timedelta(seconds=conf.TTL_SECONDS)
    updated = _update_owned(
        lease,
        status=COMPLETED,
        response_status=stored.status,
        response_headers=headers_as_json(stored.headers),
        response_body=stored.body,
        response_retained=stored.retained,
        completed_at=now,
        expires_at=expires_at,
        lease_expires_at=None,
    )
    if updated != 1:
        raise LeaseLost(f"lease on {redact(lease.identity.key)} was taken over")
    if fastpath.enabled():
        # Redis fast path hook: copy the response only once it is committed, never for a
        # rollback.
        transaction.on_commit(
            functools.partial(fastpath.completed, lease, stored, expires_at),
            using=lease.using,
            robust=True,
        )


def _update_owned(lease: Lease, **values: Any) -> int:
    """``UPDATE`` the record if this request still owns it (PROCESSING, our owner token).

    One hand-built statement, cached per connection: it runs on every request, and the ORM's
    ``update()`` spends most of its time compiling the same query again.
    """
    connection = connections[lease.using]
    sql = _update_owned_sql(lease.using, tuple(values))
    params = [_field(name).get_db_prep_save(value, connection) for name, value in values.items()]
    params += [
        lease.identity.scope,
        lease.identity.key,
        _field("owner_token").get_db_prep_save(lease.owner_token, connection),
        PROCESSING,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


@functools.lru_cache(maxsize=32)
def _update_owned_sql(using: str, names: tuple[str, ...]) -> str:
    quote = connections[using].ops.quote_name

    def column(name: str) -> str:
        return quote(str(_field(name).column))

    assignments = ", ".join(f"{column(name)} = %s" for name in names)
    return (
        f"UPDATE {quote(IdempotencyRecord._meta.db_table)} SET {assignments} "
        f"WHERE {column('scope')} = %s AND {column('key')} = %s "
        f"AND {column('owner_token')} = %s AND {column('status')} = %s"
    )


def release(lease: Lease, reason: str) -> bool:
    """Delete the record if this request still owns it, so the client can retry at once.

    Never raises: when the database is gone the lease simply expires and a retry takes over.
    """
    try:
        deleted, _ = (
            IdempotencyRecord.objects.using(lease.using)
            .for_key(lease.identity.scope, lease.identity.key)
            .filter(owner_token=lease.owner_token, status=PROCESSING)
            .delete()
        )
    except UNAVAILABLE_ERRORS:
        logger.warning(
            "idempotency release failed; the key frees itself when its lease expires",
            extra=_log_extra(lease.identity, "release_failed"),
            exc_info=True,
        )
        return False
    finally:
        fastpath.release(lease.identity, lease.owner_token)  # Redis fast path hook
    if deleted:
        _send(signals.key_released, lease.identity, reason=reason)
    return bool(deleted)


def extend(lease: Lease) -> bool:
    """Push the lease forward (heartbeat). False once the key was taken over or completed."""
    expires_at = timezone.now() + timedelta(seconds=conf.LEASE_SECONDS)
    return _update_owned(lease, lease_expires_at=expires_at) == 1


class LeaseHeartbeat:
    """Extends a lease from a background thread while a long view runs.

    The thread has its own database connection (Django's are per thread), so its updates commit
    at once instead of waiting in the view's transaction.
    """

    def __init__(self, lease: Lease, interval: float | None = None) -> None:
        self.lease = lease
        self.interval = interval if interval is not None else max(conf.LEASE_SECONDS / 3, 0.05)
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="idempotency-heartbeat", daemon=True
        )

    def __enter__(self) -> LeaseHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join()

    def _beat(self) -> None:
        connection = connections[self.lease.using]
        try:
            while not self._stopped.wait(self.interval):
                try:
                    if not extend(self.lease):
                        return
                except UNAVAILABLE_ERRORS:
                    logger.warning("idempotency heartbeat failed", exc_info=True)
        finally:
            connection.close()


# --- run -------------------------------------------------------------------------------------


class _Discard(Exception):
    """Rolls the business transaction back for a response that is not to be stored."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


def default_should_store(response: HttpResponseBase) -> bool:
    return response.status_code in conf.STORED_STATUS_CODES


def run(
    lease: Lease,
    call_view: Callable[[], HttpResponseBase],
    *,
    should_store: Callable[[HttpResponseBase], bool] = default_should_store,
    heartbeat: bool | None = None,
) -> HttpResponseBase:
    """Run the view and store its response in one transaction; release the key on failure.

    ``call_view`` must return a rendered response. Raises :class:`LeaseLost` after rolling back
    when the completion found another owner, and re-raises whatever the view raised after
    releasing the key.
    """
    beat = heartbeat if heartbeat is not None else conf.LEASE_HEARTBEAT
    if connections[lease.using].vendor == "sqlite":
        # SQLite has one writer at a time: while the view's transaction holds the write lock
        # nobody can take the key over, and a heartbeat could not write either.
        beat = False
    try:
        with (
            LeaseHeartbeat(lease) if beat else nullcontext(),
            transaction.atomic(using=lease.using),
        ):
            response = call_view()
            if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
                response.render()
            if not should_store(response):
                raise _Discard(response)
            stored = capture(response)
            complete(lease, stored)
    except _Discard as discard:
        release(lease, reason="not_stored")
        discard.response[conf.REPLAY_HEADER] = "false"
        return discard.response
    except LeaseLost:
        logger.warning("idempotency lease lost", extra=_log_extra(lease.identity, "lease_lost"))
        _send(signals.lease_lost, lease.identity)
        raise
    except BaseException:
        release(lease, reason="exception")
        raise
    _send(
        signals.request_completed,
        lease.identity,
        status=stored.status,
        retained=stored.retained,
    )
    response[conf.REPLAY_HEADER] = "false"
    return response


@instrumented("replay")  # operations: span
def replay(decision: Replay) -> HttpResponseBase:
    return replay_response(decision.response)


def refusal(decision: Conflict | Mismatch) -> IdempotencyHTTPError:
    """The HTTP error a retry gets when it may not run."""
    if isinstance(decision, Conflict):
        return TransactionInProgress(wait=decision.retry_after)
    return PayloadMismatch()


def process_request(
    request: HttpRequest,
    call_view: Callable[[], HttpResponseBase],
    *,
    should_store: Callable[[HttpResponseBase], bool] = default_should_store,
    heartbeat: bool | None = None,
) -> HttpResponseBase:
    """The whole state machine around a plain Django view (decorator and middleware)."""
    response = _process_request(request, call_view, should_store, heartbeat)
    return hand_over_cleanup(request, response)


def _process_request(
    request: HttpRequest,
    call_view: Callable[[], HttpResponseBase],
    should_store: Callable[[HttpResponseBase], bool],
    heartbeat: bool | None,
) -> HttpResponseBase:
    try:
        key = read_key(request)
        if key is None:
            return call_view()
        identity = identify(
            request, key, scope=resolve_scope(request), fingerprint=request_fingerprint(request)
        )
        decision = claim(identity)
    except IdempotencyHTTPError as error:
        return problem_response(error)
    if isinstance(decision, Replay):
        return replay(decision)
    if not isinstance(decision, Proceed):
        return problem_response(refusal(decision))
    request.idempotency = decision.lease  # type: ignore[attr-defined]
    try:
        return run(decision.lease, call_view, should_store=should_store, heartbeat=heartbeat)
    except LeaseLost:
        return problem_response(LeaseLostConflict())
    except UNAVAILABLE_ERRORS:
        logger.warning("database unavailable during an idempotent request", exc_info=True)
        return problem_response(StoreUnavailable())


# --- signals and logs ------------------------------------------------------------------------


def _announce(identity: Identity, decision: Decision) -> None:
    match decision:
        case Proceed(lease=lease):
            _send(signals.key_claimed, identity, attempt=lease.attempt)
            if lease.taken_over:
                _log_info("idempotency key taken over", identity, "taken_over", lease.attempt)
                _send(signals.key_taken_over, identity, attempt=lease.attempt)
        case Replay(response=stored):
            _log_info("idempotency replay", identity, "replayed")
            _send(signals.response_replayed, identity, status=stored.status)
        case Conflict(retry_after=retry_after):
            _log_info("idempotency conflict", identity, "conflicted")
            _send(signals.request_conflicted, identity, retry_after=retry_after)
        case Mismatch():
            _log_info("idempotency payload mismatch", identity, "mismatched")
            _send(signals.payload_mismatched, identity)


def _log_info(message: str, identity: Identity, event: str, attempt: int | None = None) -> None:
    # Checked first: building the structured fields hashes the key, on every request.
    if logger.isEnabledFor(logging.INFO):
        fields = {} if attempt is None else {"attempt": attempt}
        logger.info(message, extra=_log_extra(identity, event, **fields))


def _send(signal: Any, identity: Identity, **kwargs: Any) -> None:
    signal.send(sender=IdempotencyRecord, scope=identity.scope, key=identity.key, **kwargs)


def _log_extra(identity: Identity, event: str, **fields: Any) -> dict[str, Any]:
    key = identity.key if conf.LOG_KEYS else redact(identity.key)
    return {
        "idempotency_event": event,
        "idempotency_scope": identity.scope,
        "idempotency_key": key,
        **{f"idempotency_{name}": value for name, value in fields.items()},
    }
