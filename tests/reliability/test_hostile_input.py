"""Hostile input through every integration: the DRF mixin, the decorator (plain and below
``@api_view``) and the middleware, through Django's test client and, for what the test client
cannot express (raw header bytes, CR/LF, duplicate headers, chunked bodies), a real gunicorn.

After every request: never a 500; a refused key is a 400 problem+json that stores nothing; no
PROCESSING record remains; every COMPLETED record holds its response, and a retry replays it
byte for byte without running the view again. A body Django cannot parse at all (a broken
multipart boundary, too many fields) is Django's own 400, answered before any claim.

The views (tests/testapp/hostile_views.py) answer what they cannot read with a 4xx themselves,
so a 500 can only come from the idempotency layer. Plain DRF views are not that careful: DRF's
JSON parser lets the RecursionError of deeply nested JSON through as a 500 (the key is then
released, as for any exception).
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.db.models import Q
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from django_idempotency.db.querysets import COMPLETED, PROCESSING
from django_idempotency.models import IdempotencyRecord
from django_idempotency.request.keys import MAX_KEY_LENGTH
from tests.reliability import corpus
from tests.reliability.corpus import BODIES, KEYS, PATH_SUFFIXES, RAW, BodyCase, bounded
from tests.support.servers import gunicorn
from tests.testapp.hostile_views import ODD_METHODS
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)

PROBLEM = "application/problem+json"


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    #: Methods the idempotency layer guards on this endpoint.
    guarded: frozenset[str]
    #: Methods the endpoint answers at all (others: the framework's own 405).
    allowed: frozenset[str] | None = None


ENDPOINTS = [
    Endpoint("drf-mixin", "/api/hostile/", frozenset({"POST", "PATCH"})),
    Endpoint(
        "drf-function",
        "/api/hostile-function/",
        frozenset({"POST", "PATCH"}),
        allowed=frozenset({"POST", "PATCH", "OPTIONS"}),
    ),
    Endpoint("decorator", "/plain/hostile/", frozenset({"POST", "PATCH", *ODD_METHODS})),
    Endpoint("middleware", "/plain/middleware/hostile/", frozenset({"POST", "PATCH"})),
]
ENDPOINT_IDS = [endpoint.name for endpoint in ENDPOINTS]


# --- the invariants --------------------------------------------------------------------------


def expected_key(raw: str) -> str | None:
    """The spec (DESIGN.md, RFC 8941 sf-string or a bare token), written independently of
    ``keys.parse_key``: the key a header value names, or ``None`` for a 400."""
    value = raw.strip(" \t")
    quoted = re.fullmatch(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"', value)
    if value.startswith('"'):
        if quoted is None:
            return None
        key = re.sub(r'\\(["\\])', r"\1", quoted.group(1))
    elif re.fullmatch(r"[\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]+", value):
        key = value
    else:
        return None
    if not 1 <= len(key) <= MAX_KEY_LENGTH or key != key.strip(" "):
        return None
    return key


def assert_store_consistent() -> None:
    """No half-record: nothing left PROCESSING between requests, every COMPLETED record whole,
    and every stored key one the spec allows (so no control character ever reached the table)."""
    processing = list(IdempotencyRecord.objects.filter(status=PROCESSING).values("key", "path"))
    assert not processing, f"PROCESSING records left behind: {processing}"
    broken = IdempotencyRecord.objects.filter(status=COMPLETED).filter(
        Q(response_status__isnull=True)
        | Q(completed_at__isnull=True)
        | Q(lease_expires_at__isnull=False)
        | Q(response_retained=True, response_body__isnull=True)
    )
    assert not broken.exists(), list(broken.values("key", "response_status", "completed_at"))
    for key in IdempotencyRecord.objects.values_list("key", flat=True):
        assert 1 <= len(key) <= MAX_KEY_LENGTH, key
        assert all(" " <= char <= "~" for char in key), repr(key)
        assert key == key.strip(" "), repr(key)


@dataclass
class Outcome:
    status: int
    content: bytes
    content_type: str
    replay: str | None
    raised: BaseException | None = None


def send(
    client: APIClient,
    method: str,
    path: str,
    body: bytes,
    content_type: str | None,
    key: str | None,
) -> Outcome:
    extra: dict[str, Any] = {}
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    try:
        response = client.generic(method, path, body, content_type=content_type or "", **extra)
    except Exception as exc:  # the test client re-raises what the view chain raised: a 500
        return Outcome(500, repr(exc).encode(), "", None, raised=exc)
    content = b"".join(response.streaming_content) if response.streaming else response.content
    return Outcome(
        response.status_code,
        content,
        response.get("Content-Type", ""),
        response.get("Idempotent-Replay"),
    )


class Checker:
    """Sends one request, checks everything that must hold after it, collects what did not.

    A failure does not stop the run: the report lists every case that broke, not the first.
    """

    def __init__(self) -> None:
        self.client = APIClient()
        self.failures: list[str] = []
        self.requests = 0

    def fail(self, case: str, message: str) -> None:
        self.failures.append(f"{case}: {message}")

    def check(
        self,
        case: str,
        endpoint: Endpoint,
        *,
        method: str = "POST",
        body: bytes = b'{"name": "w"}',
        content_type: str | None = corpus.JSON,
        raw_key: str | None = None,
        path: str | None = None,
    ) -> Outcome:
        """One request and its retry; ``raw_key`` defaults to a fresh valid key."""
        raw_key = raw_key if raw_key is not None else f"hostile-{uuid.uuid4()}"
        key = expected_key(raw_key)
        path = path or endpoint.path
        records_before = IdempotencyRecord.objects.count()
        widgets_before = Widget.objects.count()
        first = send(self.client, method, path, body, content_type, raw_key)
        self.requests += 1
        label = f"{case} [{endpoint.name} {method}]"
        if first.status >= 500:
            self.fail(label, f"answered {first.status}: {first.content[:300]!r}")
        try:
            assert_store_consistent()
        except AssertionError as exc:
            self.fail(label, f"store inconsistent: {exc}")
            IdempotencyRecord.objects.all().delete()
            return first
        guarded = method in endpoint.guarded and (
            endpoint.allowed is None or method in endpoint.allowed
        )
        if guarded and key is None:
            self._check_refused(label, first, records_before, widgets_before)
        elif guarded:
            self._check_guarded(label, first, key, (method, path, body, content_type, raw_key))
        elif IdempotencyRecord.objects.count() != records_before:
            self.fail(label, "an unguarded method created a record")
        IdempotencyRecord.objects.all().delete()
        return first

    def _check_refused(
        self, label: str, first: Outcome, records_before: int, widgets_before: int
    ) -> None:
        if first.status != 400 or first.content_type != PROBLEM:
            self.fail(label, f"a bad key got {first.status} {first.content_type}")
        elif json.loads(first.content)["error"] != "idempotency_key_invalid":
            self.fail(label, f"a bad key got {first.content!r}")
        if IdempotencyRecord.objects.count() != records_before:
            self.fail(label, "a refused key created a record")
        if Widget.objects.count() != widgets_before:
            self.fail(label, "a refused key ran the view")

    def _check_guarded(
        self, label: str, first: Outcome, key: str, request: tuple[Any, ...]
    ) -> None:
        records = list(IdempotencyRecord.objects.filter(key=key))
        if not records:
            # Refused before the claim (Django's 400 for a body it cannot parse at all): fine,
            # as long as it was a client error and nothing ran.
            if not 400 <= first.status < 500:
                self.fail(label, f"no record, yet answered {first.status}")
            return
        record = records[0]
        if first.replay != "false":
            self.fail(label, f"first answer has Idempotent-Replay {first.replay!r}")
        if record.response_status != first.status:
            self.fail(label, f"stored {record.response_status}, answered {first.status}")
        if record.response_retained and bytes(record.response_body or b"") != first.content:
            self.fail(label, "the stored body differs from the answered one")
        widgets = Widget.objects.count()
        retry = send(self.client, *request)
        self.requests += 1
        if (retry.status, retry.content, retry.replay) != (first.status, first.content, "true"):
            self.fail(
                label,
                f"retry got {retry.status} replay={retry.replay} {retry.content[:200]!r}, "
                f"not the replay of {first.status} {first.content[:200]!r}",
            )
        if Widget.objects.count() != widgets:
            self.fail(label, "the retry ran the view again")

    def assert_clean(self) -> None:
        assert not self.failures, "\n".join(self.failures)


@pytest.fixture
def checker() -> Iterator[Checker]:
    checker = Checker()
    started = time.monotonic()
    yield checker
    print(f"\n{checker.requests} requests in {time.monotonic() - started:.1f} s")


# --- the corpus ------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ENDPOINT_IDS)
def test_corpus_of_keys(checker: Checker, endpoint: Endpoint) -> None:
    """Every nasty key: the valid ones store and replay, the others are a 400 that stores
    nothing and runs nothing."""
    for case in KEYS:
        assert expected_key(case.raw) == case.key, case.name  # the oracle agrees with the corpus
        checker.check(case.name, endpoint, raw_key=case.raw)
    checker.assert_clean()


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ENDPOINT_IDS)
def test_corpus_of_bodies(checker: Checker, endpoint: Endpoint) -> None:
    """Malformed, huge, deeply nested, non-UTF-8, multipart and gzip bodies, POST and PATCH."""
    for case in BODIES:
        for method in ("POST", "PATCH"):
            checker.check(
                case.name, endpoint, method=method, body=case.body, content_type=case.content_type
            )
    checker.assert_clean()


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ENDPOINT_IDS)
def test_corpus_of_methods(checker: Checker, endpoint: Endpoint) -> None:
    """Odd methods: the guarded ones store and replay, the others never create a record."""
    small = [case for case in BODIES if len(case.body) < 20_000]
    for method in corpus.METHODS:
        for case in small[::4]:
            checker.check(
                case.name, endpoint, method=method, body=case.body, content_type=case.content_type
            )
    checker.assert_clean()


def test_corpus_of_paths_through_the_middleware(checker: Checker) -> None:
    """The middleware claims before URL resolution: NUL, CR/LF and broken UTF-8 in the path
    and query reach the record's ``path`` column."""
    endpoint = ENDPOINTS[-1]
    for suffix in PATH_SUFFIXES:
        checker.check(f"path {suffix[:40]!r}", endpoint, path=endpoint.path + suffix)
    checker.assert_clean()


# --- hypothesis ------------------------------------------------------------------------------

ASCII_AND_CONTROLS = st.characters(min_codepoint=0, max_codepoint=0x7F)
header_values = st.one_of(
    st.sampled_from([case.raw for case in KEYS if len(case.raw) < 1000]),
    st.text(ASCII_AND_CONTROLS, max_size=300),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=300),
    st.text(max_size=40),  # any unicode
    st.builds(
        lambda inner, pad: f'{pad}"{inner}"{pad}',
        st.text(st.characters(min_codepoint=0x1F, max_codepoint=0x7F), max_size=260),
        st.sampled_from(["", " ", "\t"]),
    ),
)


@bounded(200)
@given(raw_key=header_values, endpoint=st.sampled_from(ENDPOINTS))
def test_any_header_value_is_stored_exactly_or_refused(raw_key: str, endpoint: Endpoint) -> None:
    """Any header value: the key the spec names is stored and replayed, anything else is a 400
    problem+json that stores nothing."""
    checker = Checker()
    checker.check("hypothesis key", endpoint, raw_key=raw_key)
    checker.assert_clean()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def bodies(draw: st.DrawFn) -> BodyCase:
    kind = draw(st.sampled_from(["json", "bytes", "corpus", "mangled"]))
    content_type = draw(
        st.sampled_from(
            [corpus.JSON, corpus.FORM, corpus.MULTIPART, "text/plain", "", "application/xml"]
            + [case.content_type or "" for case in BODIES]
        )
    )
    if kind == "json":
        indent = draw(st.sampled_from([None, 0, 2]))
        body = json.dumps(draw(json_values), indent=indent, ensure_ascii=draw(st.booleans()))
        return BodyCase("json", body.encode("utf-8", "surrogatepass"), content_type)
    if kind == "bytes":
        return BodyCase("bytes", draw(st.binary(max_size=3000)), content_type)
    small = [case for case in BODIES if len(case.body) < 300_000]
    base = draw(st.sampled_from(small))
    if kind == "corpus":
        return base
    cut = draw(st.integers(0, len(base.body)))
    noise = draw(st.binary(max_size=16))
    return BodyCase("mangled", base.body[:cut] + noise + base.body[cut:], base.content_type)


@bounded(200)
@given(
    body=bodies(),
    endpoint=st.sampled_from(ENDPOINTS),
    method=st.sampled_from(["POST", "PATCH", "PUT", "PROPFIND"]),
)
def test_any_body_never_breaks_the_store(body: BodyCase, endpoint: Endpoint, method: str) -> None:
    """Any body under any content type: never a 500, never a half-record, replays exact."""
    checker = Checker()
    checker.check(
        f"hypothesis body {body.name} {body.content_type!r} {body.body[:60]!r}",
        endpoint,
        method=method,
        body=body.body,
        content_type=body.content_type,
    )
    checker.assert_clean()


# --- raw bytes on the wire through gunicorn ---------------------------------------------------


def raw_exchange(port: int, case: corpus.RawCase, timeout: float = 30) -> tuple[int, bytes]:
    """Send ``case`` byte for byte; the status and the head and body of the answer as bytes
    (status 0 if the server just closed the connection)."""
    lines = [case.method + b" " + case.path + b" HTTP/1.1", b"Host: 127.0.0.1"]
    lines += [b"Connection: close", *case.headers]
    if not any(line.lower().startswith(b"content-type") for line in case.headers):
        lines.append(b"Content-Type: application/json")
    if case.content_length:
        lines.append(b"Content-Length: " + str(len(case.body)).encode())
    request = b"\r\n".join(lines) + b"\r\n\r\n" + case.body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    if not answer:
        return 0, b""
    head = answer.partition(b"\r\n\r\n")[0]
    return int(head.split(b" ", 2)[1]), answer


def test_raw_wire_requests_through_gunicorn() -> None:
    """CR/LF injection, NUL, obs-fold, duplicate and underscore headers, raw non-ASCII bytes,
    chunked bodies and smuggling attempts, against a real server on the real database."""
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    with gunicorn() as server:
        for case in RAW:
            records_before = IdempotencyRecord.objects.count()
            status, body = raw_exchange(server.port, case)
            outcomes[case.name] = status
            try:
                assert_store_consistent()
            except AssertionError as exc:
                failures.append(f"{case.name}: store inconsistent: {exc}")
            if status >= 500 or status == 0:
                failures.append(f"{case.name}: answered {status} {body[:300]!r}")
            records = list(IdempotencyRecord.objects.all())
            if case.key is not None:
                if status != case.status or [r.key for r in records] != [case.key]:
                    failures.append(
                        f"{case.name}: expected {case.key!r} stored, got {status} "
                        f"{[r.key for r in records]}"
                    )
                retry_status, retry = raw_exchange(server.port, case)
                if retry_status != status or b"\r\nIdempotent-Replay: true\r\n" not in retry:
                    failures.append(f"{case.name}: the retry was not a replay: {retry[:300]!r}")
            elif len(records) != records_before:
                failures.append(f"{case.name}: created {[r.key for r in records]}")
            elif case.refusal == "refused" and not 400 <= status < 500:
                failures.append(f"{case.name}: a malformed request got {status}")
            IdempotencyRecord.objects.all().delete()
    print(f"\nraw wire outcomes: {outcomes}")
    assert not failures, "\n".join(failures)
