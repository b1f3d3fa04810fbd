"""Celery tasks: thin wrappers over the plain functions the management commands call too.

Every task is ``acks_late`` and ``reject_on_worker_lost``: a worker that dies mid-task, or a
prefork pool process killed under it, leaves the message to be delivered again, as long as it
has not expired (a :data:`BEAT_SCHEDULE` entry's message expires before the entry's next run,
which then does the work); the worker logs which task it lost and what became of its message
(``operations/worker.py``). Running again is safe because every task is safe to run again and
concurrently with itself: relays coordinate through leases, sweeps delete in batches that each
re-check their condition, so a sweep killed half-way and run again finishes the job, and a sweep
that starts while another still runs skips its turn. The module imports without Celery; the
functions then stay plain functions, and the default ``OUTBOX_KICK`` (:func:`kick_relay`) relays
in a thread of the process instead of queueing a task.

Merge :data:`BEAT_SCHEDULE` into ``CELERY_BEAT_SCHEDULE`` for Celery's own scheduler. With
django-celery-beat's ``DatabaseScheduler`` call :func:`install_periodic_tasks` instead (the
``idempotency_periodic_tasks`` command does): that scheduler rewrites the periodic tasks named
in the setting from it at every start, which would undo any change made in the admin.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django_idempotency.conf import conf

__all__ = [
    "BEAT_SCHEDULE",
    "install_periodic_tasks",
    "kick_relay",
    "maintain_inbox_partitions",
    "maintain_outbox_partitions",
    "maintain_record_partitions",
    "relay_outbox",
    "sweep_idempotency_records",
    "sweep_outbox_events",
    "sweep_processed_messages",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

try:
    from celery import shared_task as _shared_task
except ImportError:  # pragma: no cover - exercised only without Celery installed
    _shared_task = None


def _task(func: F) -> F:
    if _shared_task is None:  # pragma: no cover
        return func
    task: F = _shared_task(
        acks_late=True,
        reject_on_worker_lost=True,
        ignore_result=False,
        # Loaded by the worker only: logs what became of a task whose pool process died.
        Request="django_idempotency.operations.worker:LostWorkerRequest",
    )(func)
    return task


@_task
def relay_outbox(batch_size: int | None = None, max_batches: int = 50) -> dict[str, int]:
    """Publish due outbox events until none are left (or ``max_batches``); returns the pass's
    :class:`~django_idempotency.outbox.report.RelayStats` as a dict. About once a minute per
    worker process it first tends the events held behind failed ones."""
    from django_idempotency.outbox.relay import Relay

    with Relay(batch_size=batch_size) as relay:
        relay.tend_if_due()
        return relay.drain(max_batches=max_batches).as_dict()


@_task
def sweep_idempotency_records(batch_size: int | None = None) -> int | None:
    from django_idempotency.operations.sweeps import sweep_expired_records

    return sweep_expired_records(batch_size=batch_size)


@_task
def sweep_outbox_events(batch_size: int | None = None) -> int | None:
    from django_idempotency.operations.sweeps import sweep_published_events

    return sweep_published_events(batch_size=batch_size)


@_task
def sweep_processed_messages(batch_size: int | None = None) -> int | None:
    from django_idempotency.operations.sweeps import sweep_processed_messages as sweep

    return sweep(batch_size=batch_size)


@_task
def maintain_record_partitions() -> dict[str, Any]:
    """Create the records table's partitions ahead and drop the expired ones
    (``RECORD_PARTITIONS``; a no-op without it)."""
    from django_idempotency.operations.partitions import maintain

    return maintain()


@_task
def maintain_outbox_partitions() -> dict[str, Any]:
    """Create the outbox table's partitions ahead and drop the published ones past
    ``OUTBOX_RETENTION_SECONDS`` (``OUTBOX_PARTITIONS``; a no-op without it)."""
    from django_idempotency.operations.partitions import OUTBOX, maintain

    return maintain(layout=OUTBOX)


@_task
def maintain_inbox_partitions() -> dict[str, Any]:
    """Create the inbox table's partitions ahead and drop those past
    ``INBOX_RETENTION_SECONDS`` (``INBOX_PARTITIONS``; a no-op without it)."""
    from django_idempotency.operations.partitions import INBOX, maintain

    return maintain(layout=INBOX)


class _RelayKicker:
    """Relays soon after a publishing commit, from a daemon thread, so a commit never waits.

    With Celery, the thread queues a ``relay_outbox`` task; without it, the thread relays the
    committed events itself (the first such kick in a process logs a WARNING saying so). Kicks
    that arrive while one is being served collapse into one more: a burst of commits costs two
    relay passes, not one per commit. The thread starts on first use in each process (after a
    fork too); a kick lost at exit is picked up by the periodic relay.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._wanted = threading.Event()
        self._aliases: set[str] = set()
        self._warned = False
        #: Set while the thread waits for a kick (tests wait on it).
        self.idle = threading.Event()

    def kick(self, using: str) -> None:
        if _shared_task is None and not self._warned:
            self._warned = True
            logger.warning(
                "Celery is not installed: the default OUTBOX_KICK relays the outbox in a "
                "background thread of this process. Install Celery and run a worker, or set "
                "IDEMPOTENCY['OUTBOX_KICK'] = None and run `manage.py outbox_relay --loop`."
            )
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._wanted, self.idle = threading.Event(), threading.Event()
                thread = threading.Thread(
                    target=self._run, args=(self._wanted, self.idle), daemon=True
                )
                thread.name = "django-idempotency-relay-kick"
                thread.start()
            self._aliases.add(using)
            self.idle.clear()
            self._wanted.set()

    def _run(self, wanted: threading.Event, idle: threading.Event) -> None:
        while True:
            with self._lock:  # with kick()'s lock: no kick can land between the test and set
                if not wanted.is_set():
                    idle.set()
            wanted.wait()
            wanted.clear()
            with self._lock:
                aliases, self._aliases = self._aliases, set()
            try:
                if _shared_task is None:
                    for using in sorted(aliases):
                        _relay_here(using)
                else:
                    relay_outbox.apply_async(  # type: ignore[attr-defined]
                        retry=False, expires=max(conf.OUTBOX_RELAY_LEASE_SECONDS, 60)
                    )
            except Exception as exc:
                from django_idempotency.outbox.publish import log_kick_failure

                log_kick_failure(logger, exc)


def _relay_here(using: str) -> None:
    """One relay pass in this thread, on a connection opened and closed for it."""
    from django.db import connections

    from django_idempotency.outbox.relay import Relay

    try:
        with Relay(using=using) as relay:
            relay.tend_if_due()
            relay.drain()
    finally:
        # Nothing else ends this thread's connection (no request finishes here): close it, so
        # an idle process holds none and the next pass starts on a fresh one.
        connections[using].close()


_kicker = _RelayKicker()


def kick_relay(using: str) -> None:
    """The default ``OUTBOX_KICK``: relay soon after a publishing commit, off the request.

    With Celery, a ``relay_outbox`` task is queued with ``retry=False`` (a broker outage costs a
    log line, and the relay entry of :data:`BEAT_SCHEDULE` sends the event later) and an
    ``expires`` that drops kicks queued while no worker ran: one relay pass serves them all.
    Without Celery, a thread of this process relays instead.
    """
    _kicker.kick(using)


#: Ready to merge: ``CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE, ...}``. Each entry has its own
#: interval (seconds) and its own expiry, below the interval, so a stopped worker finds at most
#: one message waiting per entry (the broker drops the others) instead of a backlog to run back
#: to back. Override an entry's interval and expiry together (``docs/tasks.md``).
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "django-idempotency-relay-outbox": {
        "task": "django_idempotency.tasks.relay_outbox",
        "schedule": 10.0,
        "options": {"expires": 9.0},
    },
    "django-idempotency-sweep-records": {
        "task": "django_idempotency.tasks.sweep_idempotency_records",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    "django-idempotency-sweep-outbox": {
        "task": "django_idempotency.tasks.sweep_outbox_events",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    "django-idempotency-sweep-inbox": {
        "task": "django_idempotency.tasks.sweep_processed_messages",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    "django-idempotency-record-partitions": {
        "task": "django_idempotency.tasks.maintain_record_partitions",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    "django-idempotency-outbox-partitions": {
        "task": "django_idempotency.tasks.maintain_outbox_partitions",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    "django-idempotency-inbox-partitions": {
        "task": "django_idempotency.tasks.maintain_inbox_partitions",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
}


def install_periodic_tasks(*, reset: bool = False, dry_run: bool = False) -> dict[str, str]:
    """Write :data:`BEAT_SCHEDULE` into django-celery-beat's periodic tasks, once.

    An entry missing from the database is created; one already there is kept as it is (its
    interval or expiry changed in the admin, disabled), unless ``reset`` puts the shipped task,
    arguments, interval and expiry back and enables it (its queue and routing stay as they
    are). Each entry gets an interval row of its own: django-celery-beat's rows are shared by
    every task that points at one, so six hourly entries on one row would all change when an
    operator edits it for one. Returns ``{entry name: "created" | "kept" | "reset"}``: what was
    done, or with ``dry_run`` what would be. Needs django-celery-beat in ``INSTALLED_APPS``.
    """
    from django.db import router, transaction
    from django_celery_beat.models import (  # type: ignore[import-untyped]
        IntervalSchedule,
        PeriodicTask,
    )

    using = router.db_for_write(PeriodicTask)
    outcomes: dict[str, str] = {}
    for name, entry in BEAT_SCHEDULE.items():
        with transaction.atomic(using=using):
            exists = PeriodicTask.objects.using(using).filter(name=name).exists()
            outcomes[name] = ("reset" if reset else "kept") if exists else "created"
            if dry_run or outcomes[name] == "kept":
                continue
            every = int(entry["schedule"])
            current = PeriodicTask.objects.using(using).filter(name=name).first()
            interval: Any = current.interval if current is not None else None
            if interval is not None and not (
                PeriodicTask.objects.using(using)
                .filter(interval=interval)
                .exclude(name=name)
                .exists()
            ):
                interval.every, interval.period = every, IntervalSchedule.SECONDS
                interval.save(using=using)
            else:
                interval = IntervalSchedule.objects.using(using).create(
                    every=every, period=IntervalSchedule.SECONDS
                )
            # save(), not a queryset update: it bumps the change marker a running beat polls.
            PeriodicTask.objects.using(using).update_or_create(
                name=name,
                defaults={
                    "task": entry["task"],
                    "args": "[]",
                    "kwargs": "{}",
                    "interval": interval,
                    "crontab": None,
                    "solar": None,
                    "clocked": None,
                    "one_off": False,
                    "enabled": True,
                    "expires": None,
                    "expire_seconds": int(entry["options"]["expires"]),
                },
            )
    return outcomes
