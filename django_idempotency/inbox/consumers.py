"""Layer 2: idempotent consumers. A marker row per handled message, in the handler's transaction.

The marker ``(consumer, message_id)`` is inserted first. A redelivered message hits the unique
constraint and is skipped; a concurrent duplicate waits on the first one's uncommitted row and
is skipped once it commits (or runs, if it rolled back); a handler that fails rolls its marker
back with its writes, so the redelivery runs again.

A failure is written down (``FailedMessage``, with its failure fingerprint) after the handler's
transaction rolled back, so the admin can group failed messages; the transaction that finally
handles the message deletes that record with the marker's insert, so both commit or neither.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from django.db import DatabaseError, IntegrityError, connections, models, router, transaction
from django.db.models.options import Options
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import conf
from django_idempotency.core.consumption import (
    DERIVED_ID_NAMESPACE,
    Consumption,
    current,
    derived_event_id,
)
from django_idempotency.core.failures import describe, failure_fingerprint, failure_traceback
from django_idempotency.db import dialect, prepared
from django_idempotency.db import postgresql as pg
from django_idempotency.exceptions import IdempotencyError, PartitionMissing
from django_idempotency.models import FailedMessage, ProcessedMessage
from django_idempotency.observability import tracing

__all__ = [
    "CONSUME_SPAN",
    "Consumption",
    "DERIVED_ID_NAMESPACE",
    "EVENT_ID_HEADER",
    "consume_once",
    "derived_event_id",
    "idempotent_consumer",
]

logger = logging.getLogger(__name__)

#: Celery message header carrying the outbox event id (see publishers/celery.py).
EVENT_ID_HEADER = "event_id"

#: The CONSUMER span around each consumption, linked to the span that published the message.
CONSUME_SPAN = "outbox.consume"

_MAX_LENGTH = 255

F = TypeVar("F", bound=Callable[..., Any])


def _text(name: str, value: Any) -> str:
    text = str(value) if isinstance(value, str | uuid.UUID | int) else None
    if not text or len(text) > _MAX_LENGTH:
        raise ValueError(
            f"{name} must be a non-empty string of at most 255 characters, not {value!r}."
        )
    return text


@contextmanager
def consume_once(
    consumer: str,
    message_id: str | uuid.UUID,
    *,
    using: str | None = None,
    traceparent: str | None = None,
) -> Iterator[Consumption]:
    """Handle ``message_id`` at most once per ``consumer`` (see :class:`Consumption`).

    The block runs in a transaction (a savepoint inside an outer one) with the marker inserted
    first; put the handler's database writes inside it. With OpenTelemetry, it runs in an
    ``outbox.consume`` span linked to ``traceparent``: pass the message's ``traceparent``
    header, and the span leads back to the request that published the message.
    """
    consumption = Consumption(
        consumer=_text("consumer", consumer),
        message_id=_text("message_id", message_id),
        duplicate=False,
    )
    using = using or router.db_for_write(ProcessedMessage)
    attributes: dict[str, tracing.AttributeValue] = {
        "messaging.operation.type": "process",
        "messaging.message.id": consumption.message_id,
        "idempotency.consumer": consumption.consumer,
    }
    # The span encloses the transaction, so it also covers (and records a failure of) the commit.
    try:
        with (
            tracing.consumer_span(CONSUME_SPAN, traceparent, attributes=attributes) as span,
            transaction.atomic(using=using),
        ):
            inserted, failure_cleared = _insert_marker(consumption, using)
            consumption.duplicate = not inserted
            if span is not None:
                span.set_attribute("idempotency.duplicate", consumption.duplicate)
            if consumption.duplicate:
                logger.info(
                    "duplicate message skipped",
                    extra={"consumer": consumption.consumer, "message_id": consumption.message_id},
                )
                signals.duplicate_skipped.send(
                    sender=ProcessedMessage,
                    consumer=consumption.consumer,
                    message_id=consumption.message_id,
                )
                yield consumption
                return
            token = current.set(consumption)
            try:
                yield consumption
            finally:
                current.reset(token)
            if not failure_cleared:
                # Handled at last: an earlier failure's record goes with this commit, or stays.
                FailedMessage.objects.using(using).for_message(
                    consumption.consumer, consumption.message_id
                ).delete()
    except Exception as error:
        if not consumption.duplicate:
            _record_failure(consumption, error, using)
        raise


def _insert_marker(consumption: Consumption, using: str) -> tuple[bool, bool]:
    """Whether the marker is new (else the message was, or is being, handled already), and
    whether the same statement deleted the message's failure record.

    One statement: a duplicate is not an error, so no savepoint is needed to survive it. On a
    partitioned inbox (``INBOX_PARTITIONS``), two: the message's lock, then the insert.
    """
    connection = connections[using]
    sql = dialect(using)
    quote = connection.ops.quote_name
    marker, failed = ProcessedMessage._meta, FailedMessage._meta
    partitioned = conf.INBOX_PARTITIONS and connection.vendor == "postgresql"
    names = (
        quote(marker.db_table),
        quote(failed.db_table),
        *(quote(_column(marker, name)) for name in ("consumer", "message_id", "processed_at")),
    )
    statement = (
        pg.insert_marker(*names, partitioned=True) if partitioned else sql.insert_marker(*names)
    )
    values = {
        "consumer": consumption.consumer,
        "message_id": consumption.message_id,
        "at": connection.ops.adapt_datetimefield_value(timezone.now()),
    }
    with prepared.cursor(connection) as cursor:
        if partitioned:
            cursor.execute(pg.INBOX_LOCK_STATEMENT, values)
        try:
            cursor.execute(statement, values)
        except IntegrityError as exc:
            if "no partition of relation" in str(exc):
                raise PartitionMissing(
                    f"No partition of {marker.db_table} covers this message's time "
                    "(IDEMPOTENCY['INBOX_PARTITIONS'] is on). Create the partitions ahead: run "
                    "`manage.py idempotency_partitions create --table inbox` now, and schedule "
                    "it (or the maintain_inbox_partitions task) daily."
                ) from exc
            raise
        inserted = cursor.rowcount == 1
    return inserted, inserted and sql.MARKER_CLEARS_FAILURE


def _column(meta: Options[Any], name: str) -> str:
    return str(cast("models.Field[Any, Any]", meta.get_field(name)).column)


def _record_failure(consumption: Consumption, error: BaseException, using: str) -> None:
    """Write down why handling the message failed, for the admin's failure groups.

    Runs after the handler's transaction (or savepoint) rolled back, in a transaction of its own;
    inside an outer transaction the record belongs to it and goes if it rolls back. Recording
    never hides the handler's error: a database that cannot take the record is logged.
    """
    now = timezone.now()
    fingerprint = failure_fingerprint(error)
    fields = {
        "last_error": describe(error),
        "failure_fingerprint": fingerprint,
        "failure_traceback": failure_traceback(error),
        "last_failed_at": now,
    }
    failures = FailedMessage.objects.using(using)
    mine = failures.for_message(consumption.consumer, consumption.message_id)
    try:
        with transaction.atomic(using=using):
            # The row lock makes concurrent failures of one message count one after the other.
            earlier = mine.select_for_update().values_list("failure_fingerprint", flat=True)
            previous = next(iter(earlier), None)
            if previous is None:
                try:
                    with transaction.atomic(using=using):  # a savepoint: a racing insert wins
                        failures.create(
                            consumer=consumption.consumer,
                            message_id=consumption.message_id,
                            failing_since=now,
                            **fields,
                        )
                    return
                except IntegrityError:
                    previous = mine.select_for_update().values_list(
                        "failure_fingerprint", flat=True
                    )[0]
            since = {} if previous == fingerprint else {"failing_since": now}
            mine.update(attempts=models.F("attempts") + 1, **since, **fields)
    except DatabaseError:
        logger.warning(
            "the consumer's failure could not be recorded",
            exc_info=True,
            extra={"consumer": consumption.consumer, "message_id": consumption.message_id},
        )


def idempotent_consumer(
    func: F | None = None,
    *,
    consumer: str | None = None,
    message_id_arg: str | None = None,
    using: str | None = None,
) -> Any:
    """Run a Celery task's body once per message. Put it *below* ``@shared_task``::

        @shared_task(acks_late=True)
        @idempotent_consumer
        def charge(order_id): ...

    The message id is the ``message_id_arg`` keyword argument when named, else the outbox's
    ``event_id`` header, else the task id (which the Celery publisher sets to the event id). The
    consumer name defaults to the task's name. A duplicate returns None without running.
    """

    def decorate(body: F) -> F:
        @functools.wraps(body)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = _running_task(args)
            name = consumer or task.name
            message_id = _message_id(task, kwargs, message_id_arg)
            traceparent = _header(task.request, tracing.TRACEPARENT)
            with consume_once(
                name, message_id, using=using, traceparent=traceparent
            ) as consumption:
                if not consumption:
                    return None
                return body(*args, **kwargs)

        # checks.py finds idempotent tasks (and their acks_late) by this mark.
        wrapper.__idempotent_consumer__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate(func) if func is not None else decorate


def _running_task(args: tuple[Any, ...]) -> Any:
    from celery import Task, current_task

    if args and isinstance(args[0], Task):  # bind=True
        return args[0]
    task = current_task._get_current_object() if current_task else None
    if task is None:
        raise IdempotencyError(
            "@idempotent_consumer only works inside a Celery task (put it below @shared_task); "
            "for other consumers use django_idempotency.inbox.consumers.consume_once()."
        )
    return task


def _message_id(task: Any, kwargs: dict[str, Any], message_id_arg: str | None) -> str:
    if message_id_arg is not None:
        if kwargs.get(message_id_arg) is None:
            raise IdempotencyError(
                f"@idempotent_consumer(message_id_arg={message_id_arg!r}): the task was called "
                f"without a {message_id_arg!r} keyword argument."
            )
        return str(kwargs[message_id_arg])
    request = task.request
    message_id = _header(request, EVENT_ID_HEADER) or request.id
    if not message_id:
        raise IdempotencyError(
            f"{task.name} was called without a task id or event_id header; call it through "
            "Celery (delay, apply_async, apply) or pass message_id_arg."
        )
    return str(message_id)


def _header(request: Any, name: str) -> Any:
    """A custom message header: a worker sets it on the request, an eager ``apply()`` in
    ``request.headers``."""
    headers = getattr(request, "headers", None) or {}
    return getattr(request, name, None) or headers.get(name)
