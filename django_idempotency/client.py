"""A client that retries right: one idempotency key per logical operation, reused on every retry.

A small layer over `httpx <https://www.python-httpx.org/>`_ (the ``client`` extra), sync
(:class:`IdempotentClient`) and async (:class:`AsyncIdempotentClient`)::

    with IdempotentClient("https://pay.example.com") as client:
        response = client.post("/api/v1/payments/", json={"amount": "25.00", ...})

The rules, shared by both:

* A write (``POST``, ``PUT``, ``PATCH``, ``DELETE``) gets a key: yours (``key=``), or a UUID made
  once for the call, sent unchanged on every retry, so a retry can never run the operation twice.
  ``response.request.headers["Idempotency-Key"]`` tells which key was sent.
* Retried: connection errors and timeouts (the request may or may not have run: the key makes
  resending safe); ``409`` (the key is held by a request still running); ``429``; ``500``,
  ``502``, ``503`` and ``504`` (a server following this app's protocol stores no 5xx and releases
  the key, so the retry runs again). Never retried: an answer marked as a replay
  (``Idempotent-Replay: true``, the stored final answer) and a ``409`` the view gave itself
  (``Idempotent-Replay: false``).
* Between attempts: ``Retry-After`` when the server sends one (seconds or an HTTP date), capped
  at ``max_retry_after``; otherwise exponential backoff with full jitter. Attempts stop at
  ``max_attempts`` or when the next wait would pass ``deadline`` seconds from the first attempt:
  then the last response is returned, or the last connection error raised.
* Every attempt sends ``Prefer: wait=N`` (``prefer_wait``), so a server that can attach a
  duplicate to the request in flight answers with its result instead of ``409``.
* A ``422`` from the idempotency layer (the key was used for a different request: same key,
  another body) raises :class:`PayloadMismatchError`; any other ``4xx`` is returned as it is.

This module needs only httpx, not Django settings: it can run in any Python service.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, Self

import httpx

__all__ = [
    "DEFAULT_HEADER",
    "DEFAULT_REPLAY_HEADER",
    "AsyncIdempotentClient",
    "IdempotencyClientError",
    "IdempotentClient",
    "PayloadMismatchError",
    "RetryPolicy",
]

logger = logging.getLogger(__name__)

#: The server's defaults (``IDEMPOTENCY["HEADER"]`` and ``["REPLAY_HEADER"]``).
DEFAULT_HEADER = "Idempotency-Key"
DEFAULT_REPLAY_HEADER = "Idempotent-Replay"
#: Methods that get a key; the others (GET, HEAD, OPTIONS) are safe to resend as they are.
KEYED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Failures after which the request may or may not have reached the server: resend with the key.
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)


class IdempotencyClientError(Exception):
    """Base of the client's errors (standalone: the client needs no Django settings)."""


class PayloadMismatchError(IdempotencyClientError):
    """The key was already used for a different request (``422 payload_mismatch``).

    A bug in the caller, never a reason to retry: a new operation needs a new key.
    """

    def __init__(self, response: httpx.Response, key: str) -> None:
        self.response = response
        self.key = key
        super().__init__(
            f"{response.request.method} {response.request.url} answered 422: the idempotency key "
            f"{key!r} was already used for a different request (method, path or body). Use a new "
            "key for a new operation; retry only with the same request."
        )


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When and how long to retry. Defaults suit an interactive API call."""

    #: Attempts in all, the first included.
    max_attempts: int = 5
    #: Seconds from the first attempt after which no retry starts (None: no limit).
    deadline: float | None = 60.0
    #: Full jitter: the n-th retry waits uniformly between 0 and min(max, base * 2**(n-1)).
    backoff_base: float = 0.25
    backoff_max: float = 10.0
    #: The longest ``Retry-After`` honoured; a longer one is waited for this long.
    max_retry_after: float = 30.0
    #: Statuses retried (unless marked as a replay; a 409 also unless the view gave it).
    retry_statuses: Collection[int] = field(
        default_factory=lambda: frozenset({409, 429, 500, 502, 503, 504})
    )
    #: Sent as ``Prefer: wait=N`` on every attempt (None: not sent).
    prefer_wait: int | None = 5

    def backoff(self, retry: int, uniform: Callable[[float, float], float]) -> float:
        """The wait before retry number ``retry`` (1 for the first), without Retry-After."""
        return uniform(0.0, min(self.backoff_max, self.backoff_base * 2 ** (retry - 1)))


def retry_after(response: httpx.Response, now: datetime | None = None) -> float | None:
    """``Retry-After`` in seconds (an integer, or an HTTP date), or None when absent or invalid."""
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass
class _Attempts:
    """One operation's attempts: whether to retry, and after how long."""

    policy: RetryPolicy
    replay_header: str
    clock: Callable[[], float]
    uniform: Callable[[float, float], float]
    started: float = 0.0
    made: int = 0

    def __post_init__(self) -> None:
        self.started = self.clock()

    def begin(self) -> None:
        self.made += 1

    def after_error(self) -> float | None:
        return self._wait(None)

    def after_response(self, response: httpx.Response) -> float | None:
        if not self._retryable(response):
            return None
        return self._wait(retry_after(response))

    def _retryable(self, response: httpx.Response) -> bool:
        if response.status_code not in self.policy.retry_statuses:
            return False
        replayed = response.headers.get(self.replay_header)
        if replayed == "true":
            return False  # the stored, final answer: it would only be replayed again
        # A 409 marked "false" is the view's own answer (stored), not a key held by another.
        return not (response.status_code == 409 and replayed is not None)

    def _wait(self, asked: float | None) -> float | None:
        if self.made >= self.policy.max_attempts:
            return None
        if asked is not None:
            wait = min(asked, self.policy.max_retry_after)
        else:
            wait = self.policy.backoff(self.made, self.uniform)
        deadline = self.policy.deadline
        if deadline is not None and self.clock() - self.started + wait > deadline:
            return None
        return wait


class _Base:
    def __init__(
        self,
        *,
        policy: RetryPolicy | None,
        header: str,
        replay_header: str,
        clock: Callable[[], float],
        uniform: Callable[[float, float], float],
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.header = header
        self.replay_header = replay_header
        self._clock = clock
        self._uniform = uniform

    def _prepare(
        self, method: str, key: str | None, headers: Mapping[str, str] | None
    ) -> tuple[str | None, httpx.Headers]:
        """The key of this operation (made once, here) and the headers of every attempt."""
        sent = httpx.Headers(headers)
        if method.upper() in KEYED_METHODS:
            key = key or sent.get(self.header) or str(uuid.uuid4())
            sent[self.header] = key
        if self.policy.prefer_wait is not None and "Prefer" not in sent:
            sent["Prefer"] = f"wait={self.policy.prefer_wait}"
        return key, sent

    def _attempts(self) -> _Attempts:
        return _Attempts(self.policy, self.replay_header, self._clock, self._uniform)

    def _final(self, response: httpx.Response, key: str | None) -> None:
        """Raise for a refused key reuse: the idempotency layer's 422 (not a view's own)."""
        if (
            key is not None
            and response.status_code == 422
            and self.replay_header not in response.headers
        ):
            raise PayloadMismatchError(response, key)


def _log_retry(method: str, url: Any, attempt: int, wait: float, why: str) -> None:
    logger.info(
        "retrying %s %s in %.2f s after attempt %d: %s",
        method,
        url,
        wait,
        attempt,
        why,
        extra={"attempt": attempt, "wait": wait},
    )


class IdempotentClient(_Base):
    """A sync ``httpx.Client`` that retries writes safely under one idempotency key.

    ``base_url`` and ``httpx_options`` build the httpx client (or pass your own ``client``,
    which is then not closed here). ``sleep``, ``clock`` and ``uniform`` are there for tests.
    """

    def __init__(
        self,
        base_url: str | httpx.URL = "",
        *,
        client: httpx.Client | None = None,
        policy: RetryPolicy | None = None,
        header: str = DEFAULT_HEADER,
        replay_header: str = DEFAULT_REPLAY_HEADER,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[float, float], float] = random.uniform,
        **httpx_options: Any,
    ) -> None:
        super().__init__(
            policy=policy, header=header, replay_header=replay_header, clock=clock, uniform=uniform
        )
        self._owned = client is None
        self.client = client or httpx.Client(
            base_url=base_url, **{"timeout": 30.0, **httpx_options}
        )
        self._sleep = sleep

    def request(
        self,
        method: str,
        url: str | httpx.URL,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send one logical operation, retried under one key; the final response.

        ``kwargs`` are httpx's (``json=``, ``content=``, ``params=``...): give a body that can be
        sent again (bytes, ``json``, ``data``), not a one-shot stream.
        """
        key, sent = self._prepare(method, key, headers)
        attempts = self._attempts()
        while True:
            attempts.begin()
            try:
                response = self.client.request(method, url, headers=sent, **kwargs)
            except RETRYABLE_ERRORS as exc:
                wait = attempts.after_error()
                if wait is None:
                    raise
                _log_retry(method, url, attempts.made, wait, type(exc).__name__)
                self._sleep(wait)
                continue
            self._final(response, key)
            wait = attempts.after_response(response)
            if wait is None:
                return response
            _log_retry(method, url, attempts.made, wait, str(response.status_code))
            self._sleep(wait)

    def post(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return self.request("POST", url, key=key, **kwargs)

    def patch(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return self.request("PATCH", url, key=key, **kwargs)

    def put(self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, key=key, **kwargs)

    def delete(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return self.request("DELETE", url, key=key, **kwargs)

    def get(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        """A read, retried on the same rules (it needs no key)."""
        return self.request("GET", url, **kwargs)

    def close(self) -> None:
        if self._owned:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncIdempotentClient(_Base):
    """:class:`IdempotentClient` over ``httpx.AsyncClient``: the same rules, awaited."""

    def __init__(
        self,
        base_url: str | httpx.URL = "",
        *,
        client: httpx.AsyncClient | None = None,
        policy: RetryPolicy | None = None,
        header: str = DEFAULT_HEADER,
        replay_header: str = DEFAULT_REPLAY_HEADER,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[float, float], float] = random.uniform,
        **httpx_options: Any,
    ) -> None:
        super().__init__(
            policy=policy, header=header, replay_header=replay_header, clock=clock, uniform=uniform
        )
        self._owned = client is None
        self.client = client or httpx.AsyncClient(
            base_url=base_url, **{"timeout": 30.0, **httpx_options}
        )
        self._sleep = sleep

    async def request(
        self,
        method: str,
        url: str | httpx.URL,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """See :meth:`IdempotentClient.request`."""
        key, sent = self._prepare(method, key, headers)
        attempts = self._attempts()
        while True:
            attempts.begin()
            try:
                response = await self.client.request(method, url, headers=sent, **kwargs)
            except RETRYABLE_ERRORS as exc:
                wait = attempts.after_error()
                if wait is None:
                    raise
                _log_retry(method, url, attempts.made, wait, type(exc).__name__)
                await self._sleep(wait)
                continue
            self._final(response, key)
            wait = attempts.after_response(response)
            if wait is None:
                return response
            _log_retry(method, url, attempts.made, wait, str(response.status_code))
            await self._sleep(wait)

    async def post(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return await self.request("POST", url, key=key, **kwargs)

    async def patch(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return await self.request("PATCH", url, key=key, **kwargs)

    async def put(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return await self.request("PUT", url, key=key, **kwargs)

    async def delete(
        self, url: str | httpx.URL, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        return await self.request("DELETE", url, key=key, **kwargs)

    async def get(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("GET", url, **kwargs)

    async def aclose(self) -> None:
        if self._owned:
            await self.client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
