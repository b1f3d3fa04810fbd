"""Publishes to NATS JetStream through nats-py, with the event id as ``Nats-Msg-Id``.

JetStream drops a second message with the same ``Nats-Msg-Id`` that arrives within the stream's
duplicate window, and answers it with an ack marked ``duplicate``. So a republish (after a
failure, a lost ack, or a relay that died between publishing and recording it) is stored once,
and its duplicate ack counts as delivered: the message is in the stream. The window must outlast
the relay's retry horizon; check ``W026`` compares the route's ``duplicate_window`` option with it.

The whole batch is put in flight, then the stream's acks are awaited together: one round trip
per batch rather than per message. nats-py is asyncio and the relay is not, so each publisher
runs its client on an event loop of its own, in a thread it owns; :meth:`NATSPublisher.close`
stops both.

A server that refuses the credentials or denies publishing to a subject, and a subject no stream
captures, are a ``BrokerConfigurationError``, not an unreachable server. nats-py tells of the
first two only through the error callback (and meanwhile keeps reconnecting, or lets the ack
time out), so the publisher listens there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from django_idempotency.exceptions import (
    BrokerConfigurationError,
    BrokerUnavailable,
    IdempotencyConfigurationError,
    PublishError,
)
from django_idempotency.publishers.base import OutboxMessage, Publisher, to_json

__all__ = ["DEFAULT_DUPLICATE_WINDOW", "MSG_ID_HEADER", "NATSPublisher", "subject_problem"]

logger = logging.getLogger(__name__)

#: The header JetStream deduplicates on.
MSG_ID_HEADER = "Nats-Msg-Id"
#: JetStream's own default duplicate window (seconds): what check W026 assumes when a route does
#: not say.
DEFAULT_DUPLICATE_WINDOW = 120.0
#: Seconds between reconnection attempts while the server is away.
_RECONNECT_WAIT = 0.5
#: JetStream's error codes for a route that cannot work as configured: stream not found, the
#: subject's stream is not the expected one, JetStream not enabled (for the account).
_CONFIGURATION_ERROR_CODES = frozenset({10059, 10060, 10039, 10076})
#: How the server words a refusal of the connection's credentials (nats-py lowercases it).
_REFUSED_CREDENTIALS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
)
_DENIED_PUBLISH = re.compile(r'permissions violation for publish to "?([^"\s]+)')
_DENIED_SUBSCRIPTION = "permissions violation for subscription to"

T = TypeVar("T")


def _nats() -> Any:
    """nats-py, imported on first use (it is an optional dependency) and typed loosely."""
    import nats
    import nats.errors
    import nats.js.errors

    return nats


def subject_problem(subject: str) -> str | None:
    """Why NATS would refuse ``subject`` as a publish subject, or None."""
    if not subject:
        return "is empty"
    if any(character.isspace() for character in subject):
        return "contains whitespace"
    tokens = subject.split(".")
    if any(not token for token in tokens):
        return "has an empty token (a leading, trailing or doubled dot)"
    if any(token in ("*", ">") for token in tokens):
        return "has a wildcard token ('*' or '>')"
    return None


class _LoopThread:
    """An asyncio event loop running in a daemon thread; coroutines are handed to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="django-idempotency-nats", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self._cancel_all(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()

    async def _cancel_all(self) -> None:
        """Cancel what the client left running (a reconnect loop, a ping timer) and wait."""
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class NATSPublisher(Publisher):
    """``OPTIONS``: ``servers`` (required: a ``nats://`` URL or a list), ``subject``
    (``"{topic}"``: the subject template), ``stream`` (None: the stream the messages must land
    in), ``duplicate_window`` (120 s: the stream's duplicate window, as configured on the
    server, for check W026), ``ack_timeout`` (10 s), ``connect_timeout`` (5 s),
    ``connect_options`` (more keyword arguments for ``nats.connect``: credentials, TLS, ...).
    """

    def __init__(
        self,
        *,
        servers: str | Sequence[str],
        subject: str = "{topic}",
        stream: str | None = None,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        ack_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        server_list = [servers] if isinstance(servers, str) else list(servers)
        # Messages never quote a server URL: it may carry a user and password.
        if not server_list or not all(isinstance(url, str) and url for url in server_list):
            raise IdempotencyConfigurationError(
                "NATSPublisher needs OPTIONS 'servers': a nats:// URL or a list of them."
            )
        if "{topic}" not in subject:
            raise IdempotencyConfigurationError(
                "NATSPublisher OPTIONS 'subject' must contain '{topic}', for example "
                "'events.{topic}'."
            )
        try:
            subject.format(topic="topic")
        except (KeyError, IndexError, ValueError):
            raise IdempotencyConfigurationError(
                "NATSPublisher OPTIONS 'subject' may hold no placeholder but '{topic}'."
            ) from None
        for name, value in (
            ("duplicate_window", duplicate_window),
            ("ack_timeout", ack_timeout),
            ("connect_timeout", connect_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise IdempotencyConfigurationError(
                    f"NATSPublisher OPTIONS {name!r} must be a positive number of seconds."
                )
        self.servers = server_list
        self.subject = subject
        self.stream = stream
        self.duplicate_window = float(duplicate_window)
        self.ack_timeout = float(ack_timeout)
        self.connect_timeout = float(connect_timeout)
        self.connect_options = dict(connect_options or {})
        self._runner: _LoopThread | None = None
        # Touched only on the runner's loop: the client; the server's refusal of its
        # credentials, once one is heard while connecting; subjects the server denied this
        # batch, and whether it denied the subscription the acks come back on.
        self._client: Any = None
        self._refused: asyncio.Future[str] | None = None
        self._denied: set[str] = set()
        self._acks_denied = False

    def subject_for(self, topic: str) -> str:
        return self.subject.format(topic=topic)

    # --- the relay's side (sync) ---------------------------------------------------------------

    def publish(self, message: OutboxMessage) -> None:
        error = self.publish_many([message])[0]
        if error is not None:
            raise error

    def publish_many(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        if not messages:
            return []
        if self._runner is None:
            self._runner = _LoopThread()
        # The coroutine bounds itself (connect, then acks); this outer bound only guards
        # against a loop that stopped answering.
        budget = self.connect_timeout + self.ack_timeout + 5
        try:
            return self._runner.run(self._publish_batch(list(messages)), timeout=budget)
        except concurrent.futures.TimeoutError:
            failure = PublishError(f"NATS publish did not finish within {budget:g} s")
            return [failure] * len(messages)

    def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        with contextlib.suppress(Exception):
            runner.run(self._disconnect(), timeout=self.connect_timeout)
        runner.stop()

    # --- on the publisher's own loop ----------------------------------------------------------

    async def _publish_batch(self, messages: list[OutboxMessage]) -> list[BaseException | None]:
        failure: PublishError
        try:
            client = await self._connected()
        except BrokerConfigurationError as exc:
            return [exc] * len(messages)
        except Exception as exc:
            failure = BrokerUnavailable(f"NATS server unreachable: {type(exc).__name__}")
            return [failure] * len(messages)
        if not client.is_connected:
            # Reconnecting after the server went away (or after it refused the credentials it
            # took before): waiting out the acks would only spend the relay's lease. The client
            # keeps reconnecting in the background.
            refusal = _refusal(client.last_error)
            if refusal is not None:
                failure = BrokerConfigurationError(f"NATS server {refusal}")
            else:
                failure = BrokerUnavailable("NATS server unreachable: the client is reconnecting")
            return [failure] * len(messages)
        self._denied.clear()
        self._acks_denied = False
        jetstream = client.jetstream(timeout=self.ack_timeout)
        # Every message goes on the wire before any ack is awaited: one round trip per batch.
        sends = [self._send(jetstream, message) for message in messages]
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        return [
            self._outcome(outcome, client, self.subject_for(message.topic))
            for outcome, message in zip(outcomes, messages, strict=True)
        ]

    async def _send(self, jetstream: Any, message: OutboxMessage) -> Any:
        subject = self.subject_for(message.topic)
        problem = subject_problem(subject)
        if problem is not None:
            raise PublishError(
                f"topic {message.topic!r} gives NATS subject {subject!r}, which {problem}"
            )
        return await jetstream.publish(
            subject,
            to_json(message.payload),
            stream=self.stream,
            headers=self._headers(message),
        )

    @staticmethod
    def _headers(message: OutboxMessage) -> dict[str, str]:
        headers = {
            **{str(name): str(value) for name, value in message.headers.items()},
            "event_id": str(message.event_id),
            "event_topic": message.topic,
            "event_key": message.key,
            **message.trace_headers(),
            MSG_ID_HEADER: str(message.event_id),
        }
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise PublishError(f"message header {name!r} holds a line break")
        return headers

    def _outcome(self, outcome: Any, client: Any, subject: str) -> BaseException | None:
        nats = _nats()
        if not isinstance(outcome, BaseException):
            if outcome.duplicate:
                # Stored by an earlier attempt within the window: delivered.
                logger.debug("NATS stream %s already had this message", outcome.stream)
            return None
        if isinstance(outcome, PublishError):
            return outcome
        if isinstance(outcome, nats.js.errors.NoStreamResponseError):
            return BrokerConfigurationError(
                f"no JetStream stream captures subject {subject!r}: create one, or change the "
                "route's 'subject'"
            )
        if isinstance(outcome, nats.js.errors.APIError):
            refused = (
                BrokerConfigurationError
                if outcome.err_code in _CONFIGURATION_ERROR_CODES
                else PublishError
            )
            return refused(
                f"JetStream refused the message: {outcome.description} "
                f"(code {outcome.code}, error {outcome.err_code})"
            )
        if isinstance(outcome, nats.errors.TimeoutError | asyncio.TimeoutError):
            # The server drops a message it denies and says so only to the error callback, in
            # words nats-py lowercases.
            if subject.lower() in self._denied:
                return BrokerConfigurationError(
                    f"NATS server denied publishing to {subject!r} (permissions violation)"
                )
            if self._acks_denied:
                return BrokerConfigurationError(
                    "NATS server denied the subscription the stream's acks come back on "
                    "(permissions violation): allow subscribing to the reply subjects (_INBOX.>)"
                )
        if isinstance(outcome, nats.errors.ConnectionClosedError) or not client.is_connected:
            return BrokerUnavailable(f"NATS server unreachable: {type(outcome).__name__}")
        if isinstance(outcome, nats.errors.TimeoutError | asyncio.TimeoutError):
            return PublishError(f"no ack from the stream within {self.ack_timeout:g} s")
        return PublishError(f"NATS publish failed: {type(outcome).__name__}")

    async def _connected(self) -> Any:
        if self._client is not None and not self._client.is_closed:
            return self._client
        client = _nats().NATS()
        options = {
            "servers": self.servers,
            "connect_timeout": self.connect_timeout,
            # A relay lives long: once connected, keep reconnecting for as long as it runs.
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": _RECONNECT_WAIT,
            **self.connect_options,
            "error_cb": self._on_error,
        }
        self._refused = asyncio.get_running_loop().create_future()
        connecting = asyncio.ensure_future(client.connect(**options))
        try:
            # nats-py counts reconnect attempts for the first connection too, and reports a
            # refusal of the credentials only to the error callback: stop at the first one, or
            # at the timeout.
            await asyncio.wait(
                {connecting, self._refused},
                timeout=self.connect_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not connecting.done() and self._refused.done():
                raise BrokerConfigurationError(f"NATS server {self._refused.result()}")
            if not connecting.done():
                raise TimeoutError
            connecting.result()
        except BaseException:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            with contextlib.suppress(Exception):
                await client.close()
            raise
        self._client = client
        if self.stream is not None:
            await self._compare_window(client)
        return client

    async def _compare_window(self, client: Any) -> None:
        """Warn when the stream's real duplicate window is shorter than the one declared."""
        try:
            info = await client.jetstream(timeout=self.ack_timeout).stream_info(self.stream)
        except Exception as exc:
            logger.warning(
                "cannot read the duplicate window of NATS stream %s: %s",
                self.stream,
                type(exc).__name__,
            )
            return
        window = info.config.duplicate_window or 0
        if window < self.duplicate_window:
            logger.warning(
                "NATS stream %s keeps message ids for %g s, less than the duplicate_window "
                "of %g s its route declares: check W026 trusted the route. Raise the stream's "
                "duplicate window, or declare the real one.",
                self.stream,
                window,
                self.duplicate_window,
            )

    async def _on_error(self, exc: Exception) -> None:
        """nats-py's error callback: notes refusals, logs the type only (messages may name a
        server URL), then calls the route's own ``error_cb``, if it has one."""
        refusal = _refusal(exc)
        if refusal is not None and self._refused is not None and not self._refused.done():
            self._refused.set_result(refusal)
        text = str(exc).lower()
        if denied := _DENIED_PUBLISH.search(text):
            self._denied.add(denied.group(1))
        elif _DENIED_SUBSCRIPTION in text:
            self._acks_denied = True
        logger.warning("NATS client error: %s", type(exc).__name__)
        callback = self.connect_options.get("error_cb")
        if callback is not None:
            await callback(exc)

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.is_closed:
            await client.close()


def _refusal(error: BaseException | None) -> str | None:
    """How the server refused the connection's credentials, if ``error`` says it did."""
    if error is None:
        return None
    if isinstance(error, _nats().errors.AuthorizationError):
        return "refused the credentials (authorization violation)"
    text = str(error).lower()
    for words in _REFUSED_CREDENTIALS:
        if words in text:
            return f"refused the credentials ({words})"
    return None
