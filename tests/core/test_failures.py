"""The failure fingerprint and the stored traceback (``core/failures.py``): pure, no database."""

from __future__ import annotations

import random

import pytest
from django.utils import timezone

from django_idempotency.core import failures
from django_idempotency.core.failures import (
    FINGERPRINT_LENGTH,
    MESSAGE_MAX_CHARS,
    TRACEBACK_MAX_FRAMES,
    describe,
    failure_fingerprint,
    failure_traceback,
    fingerprint_of,
    normalise,
)
from django_idempotency.exceptions import BrokerUnavailable, PublishError
from django_idempotency.models import OutboxEvent
from django_idempotency.outbox import ack


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("webhook answered 503 for order 1041", "webhook answered <n> for order <n>"),
        (
            "injected failure for 0b6f6a9e-5c1d-4a4e-9d59-0d9a3c1b2e7f",
            "injected failure for <uuid>",
        ),
        ("event 0b6f6a9e5c1d4a4e9d590d9a3c1b2e7f is gone", "event <uuid> is gone"),
        ("expired at 2026-11-24T02:05:07.123456+00:00, retry", "expired at <time>, retry"),
        ("expired at 2026-11-24 02:05:07Z.", "expired at <time>."),
        ("on 2026-11-24 only", "on <time> only"),
        ("timed out at 02:05:07.5", "timed out at <time>"),
        ("object at 0x7f3a2b1c9d80", "object at <hex>"),
        ("digest 9f86d081884c7d65 differs", "digest <hex> differs"),
        ("charge ch_3MmlLrLkdIwHu7ix0snN0B15 declined", "charge <id> declined"),
        ("amount 10.00 EUR over limit -5", "amount <n>.<n> EUR over limit -<n>"),
        ("connect to 127.0.0.1:5672 refused", "connect to <n>.<n>.<n>.<n>:<n> refused"),
        ("  two\n\tlines  ", "two lines"),
        # Words made of hex letters, and short codes, are words, not ids.
        ("deadbeef accepted a decade ago", "deadbeef accepted a decade ago"),
        ("HTTP error E42", "HTTP error E<n>"),
    ],
)
def test_normalise_takes_out_what_changes_from_one_event_to_the_next(message, expected):
    assert normalise(message) == expected


def test_failures_that_differ_in_ids_numbers_and_times_share_a_fingerprint():
    first = PublishError("webhook answered 503 for order 1041 at 2026-11-24T02:05:07Z")
    second = PublishError("webhook answered 504 for order 97 at 2027-01-01T00:00:00Z")
    assert failure_fingerprint(first) == failure_fingerprint(second)
    assert len(failure_fingerprint(first)) == FINGERPRINT_LENGTH
    assert set(failure_fingerprint(first)) <= set("0123456789abcdef")


def test_the_type_and_the_words_tell_failures_apart():
    base = failure_fingerprint(PublishError("webhook answered 503"))
    assert failure_fingerprint(BrokerUnavailable("webhook answered 503")) != base
    assert failure_fingerprint(PublishError("webhook refused 503")) != base


def test_a_stored_error_gives_the_same_fingerprint_as_the_exception():
    """The migration fingerprints old failures from ``last_error``; both must agree."""
    error = PublishError("x" * 3000 + " order 12")
    [failure] = ack._failures([(OutboxEvent(), error)], timezone.now(), random.Random())
    assert failure.changes["last_error"] == describe(error)
    assert len(describe(error)) == MESSAGE_MAX_CHARS
    assert fingerprint_of(describe(error)) == failure_fingerprint(error)


def test_the_model_column_holds_a_fingerprint():
    assert OutboxEvent._meta.get_field("failure_fingerprint").max_length == FINGERPRINT_LENGTH


def _raise_chain() -> BaseException:
    url = "https://" + ":".join(["user", "s3cret"]) + "@partner.example/"  # not in the source

    def connect() -> None:
        raise ConnectionRefusedError(f"connect to {url} refused")

    def publish() -> None:
        try:
            connect()
        except OSError as exc:
            raise BrokerUnavailable("webhook https://partner.example/*** unreachable") from exc

    try:
        publish()
    except BrokerUnavailable as exc:
        return exc
    raise AssertionError("not raised")


def test_the_traceback_keeps_the_frames_and_only_the_final_message():
    error = _raise_chain()
    text = failure_traceback(error)
    assert text.startswith("Traceback (most recent call last):\n")
    assert "in connect" in text and "in publish" in text  # frames of both exceptions
    assert "The above exception was the direct cause of the following exception:" in text
    # The cause shows its type alone: its text came from a library and may hold a credential.
    assert "ConnectionRefusedError (message not stored)" in text
    assert "s3cret" not in text and "user:" not in text
    assert text.rstrip().endswith(
        "django_idempotency.exceptions.BrokerUnavailable: "
        "webhook https://partner.example/*** unreachable"
    )


def test_a_suppressed_context_is_left_out():
    def handler() -> None:
        try:
            {}["missing"]
        except KeyError:
            raise PublishError("lookup failed") from None

    try:
        handler()
    except PublishError as exc:
        text = failure_traceback(exc)
    assert "KeyError" not in text and "lookup failed" in text


def test_an_implicit_context_is_shown_by_its_type():
    try:
        try:
            {}["missing"]
        except KeyError:
            raise PublishError("while handling")  # noqa: B904  (the implicit context is the point)
    except PublishError as exc:
        text = failure_traceback(exc)
    assert "During handling of the above exception, another exception occurred:" in text
    assert "KeyError (message not stored)" in text


def test_an_error_never_raised_has_no_traceback():
    assert failure_traceback(BrokerUnavailable("AMQP broker unreachable")) == ""


def _ping(depth: int) -> None:
    if depth == 0:
        raise PublishError("bottom")
    _pong(depth - 1)


def _pong(depth: int) -> None:
    _ping(depth - 1)


def test_a_deep_traceback_keeps_its_innermost_frames():
    try:
        _ping(80)
    except PublishError as exc:
        text = failure_traceback(exc)
    assert text.count('File "') == TRACEBACK_MAX_FRAMES
    assert text.rstrip().endswith("PublishError: bottom")


def test_a_long_traceback_is_cut_from_the_start(monkeypatch):
    monkeypatch.setattr(failures, "TRACEBACK_MAX_CHARS", 600)
    errors = []
    for _ in range(5):
        try:
            _ping(6)
        except PublishError as exc:
            errors.append(exc)
    for earlier, later in zip(errors, errors[1:], strict=False):
        later.__cause__ = earlier
    text = failure_traceback(errors[-1])
    head, rest = text.split("\n", 1)
    assert head.startswith("… (") and head.endswith(" characters cut)")
    assert len(rest) == 600
    assert text.rstrip().endswith("PublishError: bottom")


def test_a_cycle_in_the_chain_ends():
    first, second = PublishError("a"), PublishError("b")
    first.__cause__, second.__cause__ = second, first
    try:
        raise first
    except PublishError as exc:
        text = failure_traceback(exc)
    assert text.count("Traceback (most recent call last):") == 1
