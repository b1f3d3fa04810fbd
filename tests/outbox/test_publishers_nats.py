"""The NATS JetStream publisher, its check (W026) and the JetStream idempotent consumer, against
the local nats-server with JetStream; restarts and hangs on a private server of the test's own."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from django_idempotency import checks
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.inbox.jetstream import handle_once, message_id, run_pull_consumer
from django_idempotency.models import OutboxEvent, ProcessedMessage
from django_idempotency.outbox.relay import Relay
from django_idempotency.publishers.base import OutboxMessage
from django_idempotency.publishers.nats import NATSPublisher, subject_problem
from tests.support.nats_support import PrivateServer, Stream, nats_url, private_server, run, stream
from tests.support.outbox_support import publish_committed, settings_with, wait_for
from tests.support.servers import free_port
from tests.testapp.models import Widget

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NATS_BACKEND = "django_idempotency.publishers.nats.NATSPublisher"


@pytest.fixture
def url() -> str:
    return nats_url()


@pytest.fixture
def jetstream(url: str) -> Any:
    with stream(url, duplicate_window=600) as created:
        yield created


def message(topic: str, n: int = 0, key: str = "order-1", **headers: Any) -> OutboxMessage:
    return OutboxMessage(
        event_id=uuid.uuid4(),
        topic=topic,
        key=key,
        payload={"n": n, "total": "9.99"},
        headers=headers,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        traceparent=TRACEPARENT if n == 0 else None,
    )


def publisher(url: str, **options: Any) -> NATSPublisher:
    return NATSPublisher(servers=url, **{"ack_timeout": 5, "connect_timeout": 2, **options})


class Fast(random.Random):
    """Retries at once: the backoff's jitter always draws 0."""

    def uniform(self, a: float, b: float) -> float:
        return a


# --- publishing ---------------------------------------------------------------------------------


def test_each_event_lands_once_with_its_id_as_nats_msg_id(jetstream: Stream) -> None:
    nats_publisher = publisher(jetstream.url)
    batch = [message(f"{jetstream.prefix}.orders.paid", n, tenant="acme") for n in range(5)]
    try:
        assert nats_publisher.publish_many(batch) == [None] * 5
    finally:
        nats_publisher.close()
    stored = jetstream.messages()
    assert [m.headers["Nats-Msg-Id"] for m in stored] == [str(m.event_id) for m in batch]
    first = stored[0]
    assert first.subject == f"{jetstream.prefix}.orders.paid"
    assert json.loads(first.data) == {"n": 0, "total": "9.99"}
    assert first.headers["event_id"] == str(batch[0].event_id)
    assert first.headers["event_key"] == "order-1"
    assert first.headers["event_topic"] == f"{jetstream.prefix}.orders.paid"
    assert first.headers["tenant"] == "acme"
    assert first.headers["traceparent"] == TRACEPARENT
    assert "traceparent" not in stored[1].headers


def test_the_subject_template_and_the_expected_stream(jetstream: Stream) -> None:
    nats_publisher = publisher(
        jetstream.url, subject=f"{jetstream.prefix}.events.{{topic}}", stream=jetstream.name
    )
    wrong_stream = publisher(jetstream.url, subject=f"{jetstream.prefix}.{{topic}}", stream="NOPE")
    try:
        assert nats_publisher.publish_many([message("orders.paid")]) == [None]
        (refused,) = wrong_stream.publish_many([message("orders.paid")])
    finally:
        nats_publisher.close()
        wrong_stream.close()
    assert [m.subject for m in jetstream.messages()] == [f"{jetstream.prefix}.events.orders.paid"]
    assert isinstance(refused, PublishError) and "expected stream does not match" in str(refused)


def test_a_republished_event_is_stored_once_and_counts_as_delivered(jetstream: Stream) -> None:
    """A relay that died between publishing and recording it republishes the same ids."""
    topic = f"{jetstream.prefix}.orders.paid"
    batch = [message(topic, n) for n in range(3)]
    fresh = message(topic, 3)
    nats_publisher = publisher(jetstream.url)
    try:
        assert nats_publisher.publish_many(batch) == [None] * 3
        assert nats_publisher.publish_many([*batch, fresh]) == [None] * 4
    finally:
        nats_publisher.close()
    assert jetstream.message_ids() == [str(m.event_id) for m in [*batch, fresh]]


def test_one_bad_event_fails_alone(jetstream: Stream) -> None:
    good = message(f"{jetstream.prefix}.orders.paid")
    no_stream = message(f"nostream{uuid.uuid4().hex}.orders.paid")
    bad_subject = message(f"{jetstream.prefix}.orders paid")
    wildcard = message(f"{jetstream.prefix}.orders.*")
    nats_publisher = publisher(jetstream.url)
    try:
        results = nats_publisher.publish_many([good, no_stream, bad_subject, wildcard])
    finally:
        nats_publisher.close()
    assert results[0] is None
    assert isinstance(results[1], BrokerConfigurationError)
    assert "no JetStream stream captures subject" in str(results[1])
    assert isinstance(results[2], PublishError) and "whitespace" in str(results[2])
    assert isinstance(results[3], PublishError) and "wildcard" in str(results[3])
    assert jetstream.message_ids() == [str(good.event_id)]


def test_an_unreachable_server_fails_every_event_without_naming_its_password() -> None:
    closed = f"nats://relay:s3cret@127.0.0.1:{free_port()}"
    nats_publisher = NATSPublisher(servers=closed, connect_timeout=1)
    try:
        results = nats_publisher.publish_many([message("orders.paid", n) for n in range(3)])
        with pytest.raises(BrokerUnavailable):
            nats_publisher.publish(message("orders.paid"))
    finally:
        nats_publisher.close()
    assert all(isinstance(result, BrokerUnavailable) for result in results)
    assert "s3cret" not in str(results[0]) and "unreachable" in str(results[0])


#: A private server's users: ``relay`` may publish anywhere but to ``<prefix>.denied.>``.
USERS = """
authorization {
  users = [
    {user: relay, password: right-pa55, permissions: {publish: {deny: ["*.denied.>"]}}}
  ]
}
"""


def test_wrong_credentials_are_a_configuration_error_not_an_unreachable_server(
    tmp_path: Path,
) -> None:
    """nats-py keeps reconnecting after the server refused the credentials and says so only to
    its error callback: the publisher stops at the first refusal instead of timing out as an
    "unreachable: TimeoutError", and never names the password."""
    with private_server(tmp_path / "store", USERS, "relay:right-pa55") as server:
        nats_publisher = publisher(server.url_with("relay:wrong-pa55"), connect_timeout=10)
        try:
            started = time.monotonic()
            results = nats_publisher.publish_many([message("orders.paid", n) for n in range(3)])
            elapsed = time.monotonic() - started
        finally:
            nats_publisher.close()
    assert all(isinstance(result, BrokerConfigurationError) for result in results), results
    assert str(results[0]) == "NATS server refused the credentials (authorization violation)"
    assert elapsed < 5  # the first refusal, not the connect timeout
    assert "pa55" not in str(results[0])


def test_a_denied_subject_is_a_configuration_error_and_allowed_ones_go_out(
    tmp_path: Path,
) -> None:
    """The server drops a message the user may not publish and reports it only to the error
    callback; the ack then times out, and the publisher names the denial instead."""
    with (
        private_server(tmp_path / "store", USERS, "relay:right-pa55") as server,
        stream(server.url_with("relay:right-pa55")) as created,
    ):
        allowed = message(f"{created.prefix}.orders.paid")
        denied = message(f"{created.prefix}.denied.Paid")  # nats-py lowercases the denial
        nats_publisher = publisher(server.url_with("relay:right-pa55"), ack_timeout=1)
        try:
            results = nats_publisher.publish_many([allowed, denied])
        finally:
            nats_publisher.close()
        stored = created.message_ids()
    assert results[0] is None and stored == [str(allowed.event_id)]
    assert isinstance(results[1], BrokerConfigurationError)
    assert "denied publishing to" in str(results[1]) and ".denied.Paid" in str(results[1])


def test_the_wrong_expected_stream_is_a_configuration_error(jetstream: Stream) -> None:
    nats_publisher = publisher(jetstream.url, stream=f"NO_SUCH_{uuid.uuid4().hex[:8].upper()}")
    try:
        (result,) = nats_publisher.publish_many([message(f"{jetstream.prefix}.orders.paid")])
    finally:
        nats_publisher.close()
    assert isinstance(result, BrokerConfigurationError)
    assert "expected stream does not match" in str(result) and "10060" in str(result)


def test_a_server_that_hangs_fails_each_event_then_they_go_out_once(tmp_path: Path) -> None:
    with private_server(tmp_path / "store") as server, stream(server.url) as created:
        topic = f"{created.prefix}.orders.paid"
        nats_publisher = publisher(server.url, ack_timeout=1)
        batch = [message(topic, n) for n in range(4)]
        try:
            assert nats_publisher.publish_many([batch[0]]) == [None]  # connected
            server.pause()
            try:
                results = nats_publisher.publish_many(batch[1:])
            finally:
                server.resume()
            assert all(isinstance(result, PublishError) for result in results), results
            # The retry goes out once the server answers; whatever reached it before is not
            # stored again.
            retried = wait_for(
                lambda: (r := nats_publisher.publish_many(batch[1:])) == [None] * 3 and r,
                timeout=30,
                what="the retry after the hang",
            )
            assert retried
        finally:
            nats_publisher.close()
        assert created.message_ids() == [str(m.event_id) for m in batch]


def test_options_are_checked_without_quoting_the_servers() -> None:
    with pytest.raises(IdempotencyConfigurationError, match="servers"):
        NATSPublisher(servers=[])
    with pytest.raises(IdempotencyConfigurationError, match="topic"):
        NATSPublisher(servers="nats://u:secret@h:4222", subject="events")
    with pytest.raises(IdempotencyConfigurationError, match="placeholder"):
        NATSPublisher(servers="nats://h:4222", subject="{tenant}.{topic}")
    with pytest.raises(IdempotencyConfigurationError, match="ack_timeout") as caught:
        NATSPublisher(servers="nats://u:secret@h:4222", ack_timeout=0)
    assert "secret" not in str(caught.value)


def test_subject_problems() -> None:
    assert subject_problem("orders.paid") is None
    assert subject_problem("") == "is empty"
    assert "empty token" in str(subject_problem("orders..paid"))
    assert "empty token" in str(subject_problem(".orders"))
    assert "wildcard" in str(subject_problem("orders.>"))
    assert "whitespace" in str(subject_problem("orders\tpaid"))


def test_close_stops_the_loop_thread_and_a_closed_publisher_can_publish_again(
    jetstream: Stream,
) -> None:
    nats_publisher = publisher(jetstream.url)
    assert nats_publisher.publish_many([message(f"{jetstream.prefix}.a")]) == [None]
    runner = nats_publisher._runner
    assert runner is not None and runner.thread.is_alive()
    nats_publisher.close()
    assert not runner.thread.is_alive() and runner.loop.is_closed()
    assert nats_publisher.publish_many([message(f"{jetstream.prefix}.b")]) == [None]
    nats_publisher.close()
    assert len(jetstream.messages()) == 2


# --- through the relay --------------------------------------------------------------------------


def nats_route(url: str, prefix: str, backend: str = NATS_BACKEND, **options: Any) -> Any:
    return {
        f"{prefix}.*": {
            "BACKEND": backend,
            "OPTIONS": {"servers": url, "ack_timeout": 3, "connect_timeout": 2, **options},
        }
    }


def drain_until_published(relay: Relay, count: int) -> None:
    def all_published() -> bool:
        relay.drain()
        return OutboxEvent.objects.published().count() == count

    wait_for(all_published, timeout=90, what=f"{count} events published")


@pytest.mark.django_db(transaction=True)
def test_the_relay_publishes_through_a_nats_route_and_a_dead_relay_costs_no_duplicate(
    jetstream: Stream,
) -> None:
    topic = f"{jetstream.prefix}.paid"
    with settings_with(OUTBOX_PUBLISHERS=nats_route(jetstream.url, jetstream.prefix)):
        events = [publish_committed(topic, {"n": n}) for n in range(4)]
        # A relay published the first two, then died before recording it: they stay PENDING.
        dead_relay = publisher(jetstream.url)
        try:
            sent = [OutboxMessage.from_event(event) for event in events[:2]]
            assert dead_relay.publish_many(sent) == [None, None]
        finally:
            dead_relay.close()
        with Relay() as relay:
            stats = relay.drain()
    assert stats.published == 4 and stats.failed == 0
    assert OutboxEvent.objects.published().count() == 4
    assert jetstream.message_ids() == [str(event.event_id) for event in events]


@pytest.mark.django_db(transaction=True)
def test_the_relay_records_wrong_credentials_as_a_configuration_error(tmp_path: Path) -> None:
    """What the operator reads: the credentials, not "unreachable: TimeoutError"; the event
    waits the backoff's ceiling, and goes out once the route has the right password."""
    with (
        private_server(tmp_path / "store", USERS, "relay:right-pa55") as server,
        stream(server.url_with("relay:right-pa55")) as created,
    ):
        topic = f"{created.prefix}.paid"
        wrong = nats_route(server.url_with("relay:wrong-pa55"), created.prefix)
        with settings_with(OUTBOX_PUBLISHERS=wrong, OUTBOX_MAX_ATTEMPTS=1):
            event = publish_committed(topic)
            with Relay() as relay:
                assert relay.run_once().failed == 1
        event.refresh_from_db()
        assert event.last_error == (
            "BrokerConfigurationError: NATS server refused the credentials "
            "(authorization violation)"
        )
        assert (event.failure_kind, event.status) == ("configuration", OutboxStatus.PENDING)
        assert event.last_failed_at is not None
        assert (event.next_attempt_at - event.last_failed_at).total_seconds() == 600
        right = nats_route(server.url_with("relay:right-pa55"), created.prefix)
        OutboxEvent.objects.filter(pk=event.pk).update(next_attempt_at=event.last_failed_at)
        with settings_with(OUTBOX_PUBLISHERS=right), Relay() as relay:
            assert relay.drain().published == 1
        assert created.message_ids() == [str(event.event_id)]


class RestartingPublisher(NATSPublisher):
    """Restarts the private server in the middle of its first batch: after ``after`` messages
    are on their way, before the rest are sent and before any ack is awaited."""

    def __init__(self, *, server: PrivateServer, after: int, **options: Any) -> None:
        super().__init__(**options)
        self.server = server
        self.after = after
        self.sent = 0

    async def _send(self, jetstream: Any, message: OutboxMessage) -> Any:
        self.sent += 1
        if self.sent == self.after:
            # In a thread: the loop goes on flushing what was sent, and the acks that make it.
            await asyncio.get_running_loop().run_in_executor(None, self.server.restart)
        return await super()._send(jetstream, message)


@pytest.mark.django_db(transaction=True)
def test_nats_restarted_mid_batch_loses_nothing_and_stores_nothing_twice(tmp_path: Path) -> None:
    count = 200
    with private_server(tmp_path / "store") as server, stream(server.url) as created:
        topic = f"{created.prefix}.paid"
        routes = nats_route(
            server.url,
            created.prefix,
            backend=f"{__name__}.RestartingPublisher",
            server=server,
            after=count // 2,
        )
        fast_retries = {"OUTBOX_BACKOFF_BASE_SECONDS": 0.01, "OUTBOX_BACKOFF_MAX_SECONDS": 0.05}
        with settings_with(OUTBOX_PUBLISHERS=routes, **fast_retries):
            events = [publish_committed(topic, {"n": n}) for n in range(count)]
            ids = sorted(str(event.event_id) for event in events)
            with Relay(batch_size=count, rng=Fast()) as relay:
                first = relay.run_once()
                assert first.claimed == count  # one batch, restarted in its middle
                drain_until_published(relay, count)
                stored = created.message_ids()
                assert sorted(stored) == ids and len(stored) == count

                # Restart again, then republish everything, as relays that died before their
                # acks would: the stream's deduplication survived both restarts.
                server.restart()
                OutboxEvent.objects.update(status=OutboxStatus.PENDING, published_at=None)
                drain_until_published(relay, count)
        assert sorted(created.message_ids()) == ids
        assert len(created.messages()) == count


# --- check W026 ---------------------------------------------------------------------------------


def w026(settings: Any, **values: Any) -> list[str]:
    from tests import settings as test_settings

    settings.IDEMPOTENCY = {**test_settings.IDEMPOTENCY, **values}
    return [message.msg for message in checks.BY_ID[checks.W026]()]


def test_w026_compares_the_declared_window_with_the_retry_horizon(settings: Any) -> None:
    horizon = {
        "OUTBOX_MAX_ATTEMPTS": 4,
        "OUTBOX_BACKOFF_BASE_SECONDS": 1,
        "OUTBOX_BACKOFF_MAX_SECONDS": 3,
        "OUTBOX_RELAY_LEASE_SECONDS": 5,
    }  # 1 + 2 + 3 s of backoff, plus one lease of 5 s: 11 s
    route = {"BACKEND": NATS_BACKEND, "OPTIONS": {"servers": "nats://u:pw@h:4222"}}

    def with_window(window: float) -> Any:
        return {"*": {**route, "OPTIONS": {**route["OPTIONS"], "duplicate_window": window}}}

    (found,) = w026(settings, OUTBOX_PUBLISHERS=with_window(10.5), **horizon)
    assert "duplicate window, 10.5 s (the route's duplicate_window)" in found
    assert "retry horizon of 11 s" in found and "pw" not in found
    assert w026(settings, OUTBOX_PUBLISHERS=with_window(11), **horizon) == []
    # Undeclared: JetStream's default of two minutes, against the default horizon (526 s).
    (default,) = w026(settings, OUTBOX_PUBLISHERS={"*": route})
    assert "120 s (JetStream's default; the route declares no duplicate_window)" in default
    assert "526 s" in default
    # Other publishers, and invalid settings (E022 reports them), are not its business.
    assert w026(settings, OUTBOX_PUBLISHERS={"*": "django_idempotency.publishers.log."
                "LoggingPublisher"}) == []  # fmt: skip
    assert w026(settings, OUTBOX_PUBLISHERS={"*": route}, OUTBOX_MAX_ATTEMPTS=0) == []


# --- the JetStream idempotent consumer ----------------------------------------------------------


async def pull(url: str, created: Stream, ack_wait: float = 30) -> tuple[Any, Any]:
    client = await nats.connect(url)
    config = nats.js.api.ConsumerConfig(ack_wait=ack_wait, max_deliver=10)
    subscription = await client.jetstream().pull_subscribe(
        f"{created.prefix}.>", durable=f"ditest{uuid.uuid4().hex[:8]}", config=config
    )
    return client, subscription


async def publish_one(url: str, subject: str, msg_id: str | None) -> None:
    client = await nats.connect(url)
    try:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await client.jetstream().publish(subject, b'{"name": "w"}', headers=headers)
    finally:
        await client.close()


async def close_worker_connections() -> None:
    """The handler ran in asgiref's thread for sync code: close that thread's connections."""
    await sync_to_async(connections.close_all, thread_sensitive=True)()


def create_widget(msg: Any) -> None:
    Widget.objects.create(name=json.loads(msg.data)["name"], created_by=msg.subject)


@pytest.mark.django_db(transaction=True)
def test_the_consumer_acks_only_after_the_marker_committed_and_skips_redeliveries(
    jetstream: Stream,
) -> None:
    event_id = str(uuid.uuid4())
    seen_at_ack: list[bool] = []

    def marker_committed() -> bool:
        # A fresh thread, hence a connection of its own: it sees committed rows only.
        exists = ProcessedMessage.objects.filter(consumer="ledger", message_id=event_id).exists()
        connections.close_all()
        return exists

    async def scenario() -> tuple[bool, bool, int]:
        await publish_one(jetstream.url, f"{jetstream.prefix}.paid", event_id)
        client, subscription = await pull(jetstream.url, jetstream, ack_wait=1)
        try:
            (first,) = await subscription.fetch(1, timeout=5)

            async def lost_ack() -> None:  # the consumer "dies" right after its commit
                seen_at_ack.append(await sync_to_async(marker_committed, thread_sensitive=False)())

            first.ack = lost_ack
            ran = await handle_once(first, create_widget, consumer="ledger")
            # Redelivered after ack_wait, since no ack reached the server.
            (again,) = await subscription.fetch(1, timeout=10)
            assert again.metadata.num_delivered == 2
            ran_again = await handle_once(again, create_widget, consumer="ledger")
            await client.flush()
            return ran, ran_again, await settled_ack_pending(subscription)
        finally:
            await close_worker_connections()
            await client.close()

    ran, ran_again, unacked = run(scenario())
    assert (ran, ran_again) == (True, False)
    assert seen_at_ack == [True]
    assert unacked == 0
    assert Widget.objects.count() == 1
    assert ProcessedMessage.objects.filter(consumer="ledger", message_id=event_id).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_failing_handler_rolls_back_naks_and_runs_again(jetstream: Stream) -> None:
    calls: list[int] = []

    def flaky(msg: Any) -> None:
        create_widget(msg)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("downstream timed out")

    async def scenario() -> None:
        await publish_one(jetstream.url, f"{jetstream.prefix}.paid", None)
        client, subscription = await pull(jetstream.url, jetstream)
        stop = asyncio.Event()

        async def stop_after_second_call() -> None:
            while len(calls) < 2:
                await asyncio.sleep(0.05)
            stop.set()

        try:
            await asyncio.wait_for(
                asyncio.gather(
                    run_pull_consumer(
                        subscription, flaky, consumer="ledger", fetch_timeout=0.5, stop=stop
                    ),
                    stop_after_second_call(),
                ),
                timeout=60,
            )
            await client.flush()
            assert await settled_ack_pending(subscription) == 0
        finally:
            await close_worker_connections()
            await client.close()

    run(scenario())
    assert len(calls) == 2
    assert Widget.objects.count() == 1  # the first attempt's row rolled back with its marker
    (marker,) = ProcessedMessage.objects.filter(consumer="ledger")
    assert marker.message_id == f"{jetstream.name}:1"  # no Nats-Msg-Id: stream and sequence


def test_every_fetch_timeout_nats_py_raises_is_an_empty_batch() -> None:
    """nats-py 2.15+ raises a bare asyncio.TimeoutError when the server's 408 for its no-wait
    probe lands as the fetch's deadline passes (about one empty fetch in 25 here), where older
    releases raised nats.errors.TimeoutError; the consumer must go on after any of them."""
    timeouts: list[BaseException] = [
        nats.errors.TimeoutError(),
        nats.js.errors.FetchTimeoutError(),
        TimeoutError(),  # asyncio.TimeoutError, as fetch() raises it bare
    ]
    stop = asyncio.Event()
    fetched: list[tuple[int, float]] = []

    class Subscription:
        async def fetch(self, batch: int, timeout: float) -> list[Any]:
            fetched.append((batch, timeout))
            if timeouts:
                raise timeouts.pop(0)
            stop.set()
            return []

    def never(msg: Any) -> None:
        raise AssertionError("no message was fetched")

    run(
        run_pull_consumer(
            Subscription(), never, consumer="ledger", batch=3, fetch_timeout=0.5, stop=stop
        )
    )
    assert fetched == [(3, 0.5)] * 4

    class Closed:
        async def fetch(self, batch: int, timeout: float) -> list[Any]:
            raise nats.errors.ConnectionClosedError

    with pytest.raises(nats.errors.ConnectionClosedError):  # not a timeout: not swallowed
        run(run_pull_consumer(Closed(), never, consumer="ledger"))


def test_message_id_prefers_the_nats_msg_id_header() -> None:
    class Msg:
        headers = {"Nats-Msg-Id": "evt-1"}

    assert message_id(Msg()) == "evt-1"


async def settled_ack_pending(subscription: Any, seconds: float = 15) -> int:
    """The consumer's count of unacknowledged messages, once the server has applied the acks
    already sent: it applies them on its own time, so a count read at once may be one high."""
    for _ in range(int(seconds / 0.1)):
        info = await subscription.consumer_info()
        if info.num_ack_pending == 0:
            return 0
        await asyncio.sleep(0.1)
    return int(info.num_ack_pending)
