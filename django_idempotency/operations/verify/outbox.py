"""The check that the outbox loses nothing when a relay is killed between publish and ack.

Three events with one key on a scratch topic; a child relay publishes them, reports what it
sent, and is killed before its ack; a second relay takes the batch over once the first one's
lease ends (or at once, where its session lock says it is gone). Every event ends PUBLISHED, and
what the first relay sent goes out again with the same event id.

The project's own relays never claim the scratch events: they wait behind a "gate", an earlier
event with the same key leased for a day, and only this check's relays, which see nothing but
this run's events (``Relay(only=...)``), pass it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import router, transaction
from django.db.models import Q
from django.test.utils import override_settings

from django_idempotency.conf import conf
from django_idempotency.db import database_now, session_locks
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import OutboxEvent
from django_idempotency.operations.verify.harness import (
    ChildUnavailable,
    await_line,
    kill,
    spawned,
)
from django_idempotency.operations.verify.results import Result, VerifyOptions
from django_idempotency.operations.verify.scratch import PREFIX, Scratch
from django_idempotency.outbox.publish import publish
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.base import OutboxMessage, Publisher
from django_idempotency.publishers.memory import broker
from django_idempotency.publishers.routing import Route, build, resolve_route

__all__ = ["HaltingPublisher", "child", "killed_relay"]

_EVENTS = 3


def _scratch_relay(event_ids: Sequence[int], **kwargs: Any) -> Relay:
    """A relay that sees only this run's scratch events, never the project's own (nor the
    gate, which holds the project's relays back from them)."""
    return Relay(only=Q(pk__in=list(event_ids)), **kwargs)


class HaltingPublisher(Publisher):
    """For the relay the outbox check kills: publishes (through ``inner``, the route the child
    resolved from its own settings, or the in-memory broker), reports the ids on stdout, then
    waits to be killed before its ack."""

    def __init__(self, *, inner: Route | None = None) -> None:
        super().__init__()
        self.inner = build(inner) if inner is not None else None

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if self.inner is not None:
            results = self.inner.publish_many(messages)
        else:
            for message in messages:
                broker.receive(message)
            results = [None] * len(messages)
        sent = [str(m.event_id) for m, error in zip(messages, results, strict=True) if not error]
        print("PUBLISHED", " ".join(sent), flush=True)
        time.sleep(3600)  # killed here: published, never acknowledged
        return results


def killed_relay(scratch: Scratch, options: VerifyOptions) -> Result:
    """Relay A publishes and is killed before its ack; relay B must send everything, again."""
    name = "outbox survives a killed relay"
    using = router.db_for_write(OutboxEvent)
    topic = options.outbox_topic or scratch.topic
    gate_topic = f"{scratch.topic}.gate"
    memory = "django_idempotency.publishers.memory.MemoryPublisher"
    user_routes = dict(conf.OUTBOX_PUBLISHERS)
    if options.outbox_topic is not None:
        resolve_route(topic, user_routes)  # unroutable: fails here, not in the child
    routes = {
        gate_topic: memory,
        **({} if options.outbox_topic else {topic: memory}),
        **user_routes,
    }
    quiet = {"OUTBOX_PUBLISHERS": routes, "OUTBOX_KICK": None, "OUTBOX_NOTIFY": False}
    with (
        override_settings(IDEMPOTENCY={**getattr(settings, "IDEMPOTENCY", {}), **quiet}),
        _gate_held(using) as gate_token,
    ):
        events = _scratch_events(scratch, topic, gate_topic, gate_token, using)
        ids = [event.pk for event in events]
        wanted = {str(event.event_id) for event in events}
        # The route's OPTIONS hold passwords and signing secrets: the child gets the topic and
        # resolves the route from its own settings, so nothing secret is on its command line.
        arguments = {
            "ids": ids,
            "topic": topic,
            "routed": options.outbox_topic is not None,
            "lease": options.lease_seconds,
        }
        try:
            with spawned(__name__, arguments) as child_process:
                first = set(await_line(child_process, "PUBLISHED", options.timeout).split())
                kill(child_process)
        except ChildUnavailable as problem:
            return Result(name, None, f"not run: {problem}")
        before = len(broker.snapshot())
        republished: list[str] = []
        deadline = time.monotonic() + options.lease_seconds + options.timeout
        with _scratch_relay(ids, using=using) as relay:
            while time.monotonic() < deadline:
                stats = relay.drain()
                if OutboxEvent.objects.using(using).filter(
                    pk__in=ids, status=OutboxStatus.PUBLISHED
                ).count() == len(ids):
                    break
                if not stats.claimed:
                    time.sleep(0.2)
        if options.outbox_topic is None:
            republished = [
                str(message.event_id)
                for message in broker.snapshot()[before:]
                if str(message.event_id) in wanted
            ]
        published = OutboxEvent.objects.using(using).filter(
            pk__in=ids, status=OutboxStatus.PUBLISHED
        )
        lost = len(ids) - published.count()
    if options.outbox_topic is None:
        again = len(first & set(republished))
        second = f"{len(republished)} ({again} of them again, with the same event id)"
    else:
        second = "them through the route configured for the topic"
    evidence = (
        f"{len(ids)} scratch events on {topic!r} (one key); relay A (pid {child_process.pid}, "
        f"lease {options.lease_seconds:g} s) published {len(first)} and was killed before its "
        f"ack; relay B, after that lease, published {second}; "
        f"PUBLISHED: {published.count()}, lost: {lost}"
    )
    passed = lost == 0 and bool(first) and first <= wanted
    if options.outbox_topic is None:
        passed = passed and set(republished) == wanted
    return Result(name, passed, evidence)


@contextlib.contextmanager
def _gate_held(using: str) -> Iterator[uuid.UUID]:
    """The token of the gate's lease, with its relay lock held on this connection while the
    check runs: a lease whose lock nobody holds is a gone relay's, which the project's relays
    release at once (``outbox.fleet.GoneRelays``), and would then publish the gate
    and take the scratch events before this run's relays."""
    token = uuid.uuid4()
    held = session_locks.enabled(using)
    if held:
        session_locks.hold_batch(using, token)
    try:
        yield token
    finally:
        if held:
            session_locks.let_go_of_batch(using, token)


def _scratch_events(
    scratch: Scratch, topic: str, gate_topic: str, gate_token: uuid.UUID, using: str
) -> list[OutboxEvent]:
    """The scratch events, behind a gate only this run's relays can pass.

    The gate is an earlier event with the same key, leased for a day under ``gate_token`` (see
    :func:`_gate_held`): every relay of the project holds later events of a key back while an
    earlier one is leased elsewhere, so none of them ever claims these. The scratch relays see
    only the scratch events, not the gate.
    """
    key = scratch.key("outbox")
    with transaction.atomic(using=using):
        gate = publish(gate_topic, {"gate": scratch.run}, key=key, using=using)
        OutboxEvent.objects.using(using).filter(pk=gate.pk).update(
            locked_until=database_now(using) + timedelta(days=1), relay_token=gate_token
        )
        events = [
            publish(topic, {PREFIX: scratch.run, "n": n}, key=key, using=using)
            for n in range(_EVENTS)
        ]
    scratch.event_ids.update([gate.pk, *(event.pk for event in events)])
    return events


def child(arguments: dict[str, Any]) -> None:
    """Relay A, in its child process: publishes the scratch events through
    :class:`HaltingPublisher`, which waits to be killed before the ack."""
    # Resolved here, from this process's settings, before they route the topic to the halting
    # publisher: the parent never passes a route's OPTIONS (see killed_relay).
    inner = resolve_route(arguments["topic"]) if arguments["routed"] else None
    halting = {"BACKEND": f"{__name__}.HaltingPublisher", "OPTIONS": {"inner": inner}}
    halted = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "OUTBOX_PUBLISHERS": {arguments["topic"]: halting},
        "OUTBOX_KICK": None,
    }
    with (
        override_settings(IDEMPOTENCY=halted),
        _scratch_relay(arguments["ids"], lease_seconds=arguments["lease"]) as relay,
    ):
        relay.run_once()
