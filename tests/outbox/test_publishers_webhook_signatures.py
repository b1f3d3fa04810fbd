"""``verify_signature()`` answers False, never raises, whatever a client puts in the header; a
receiver written as docs/publishers.md shows answers every bad signature 401."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.publishers.webhook import MAX_SIGNATURE_LENGTH, sign, verify_signature

SECRET = "whsec-test"
BODY = b'{"event_id": "e-1"}'
NOW = 1_700_000_000
GOOD = f"t={NOW},v1={sign(SECRET, NOW, BODY)}"
DOCS = Path(__file__).resolve().parents[2] / "docs"

#: Malformed headers a client can send, each a way a parser trips.
MALFORMED = {
    "non-ASCII, as a WSGI server decodes the byte 0xE9": f"t={NOW},v1=\xe9",
    "non-ASCII digits": f"t={'١٧٠٠٠٠٠٠٠٠'},v1={sign(SECRET, NOW, BODY)}",
    "non-ASCII beside a valid signature": GOOD + ",v1=\xe9",
    "oversized": GOOD + "," + "x=" + "a" * MAX_SIGNATURE_LENGTH,
    "oversized timestamp": f"t={'9' * 4000},v1={sign(SECRET, NOW, BODY)}",
    "no timestamp": f"v1={sign(SECRET, NOW, BODY)}",
    "no signature": f"t={NOW}",
    "a part without '='": GOOD + ",v1",
    "repeated timestamp": f"t={NOW},{GOOD}",
    "repeated signature": f"{GOOD},v1={'0' * 64}",
    "an unknown part": GOOD + ",v0=abc",
    "upper-case hex": f"t={NOW},v1={sign(SECRET, NOW, BODY).upper()}",
    "spaces": f"t={NOW}, v1={sign(SECRET, NOW, BODY)}",
    "empty": "",
    "missing": None,
}


def test_a_good_signature_verifies() -> None:
    assert verify_signature(SECRET, BODY, GOOD, now=NOW)
    assert verify_signature(SECRET.encode(), BODY, GOOD, now=NOW + 300)
    assert not verify_signature(SECRET, BODY, GOOD, now=NOW + 301)
    assert not verify_signature("other", BODY, GOOD, now=NOW)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_signature_is_false(case: str) -> None:
    assert verify_signature(SECRET, BODY, MALFORMED[case], now=NOW) is False


@given(header=st.text(max_size=400))
def test_any_text_is_a_bool_never_an_exception(header: str) -> None:
    assert verify_signature(SECRET, BODY, header, now=NOW) is (header == GOOD)


def _parts() -> st.SearchStrategy[str]:
    good = GOOD.split(",")
    junk = st.text(max_size=80)
    named = st.builds(lambda name, value: f"{name}={value}", st.sampled_from(["t", "v1"]), junk)
    return st.one_of(st.sampled_from(good), named, junk)


@given(parts=st.lists(_parts(), max_size=6))
def test_headers_assembled_from_good_and_bad_parts(parts: list[str]) -> None:
    """Good parts dropped, repeated, reordered, or mixed with bad ones: True only for exactly
    one good timestamp and one good signature, in either order."""
    header = ",".join(parts)
    expected = sorted(parts) == sorted(GOOD.split(","))
    assert verify_signature(SECRET, BODY, header, now=NOW) is expected


def docs_receiver() -> Callable[[HttpRequest], HttpResponse]:
    """The receiver docs/publishers.md shows, as a view: its code block, then a 204."""
    page = (DOCS / "publishers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    (snippet,) = [block for block in blocks if "verify_signature(" in block]
    source = (
        "def receive(request):\n"
        + textwrap.indent(snippet, "    ")
        + "    return HttpResponse(status=204)\n"
    )
    namespace: dict[str, Any] = {"HttpResponse": HttpResponse, "SECRET": SECRET}
    exec(compile(source, "docs/publishers.md", "exec"), namespace)  # noqa: S102
    receive: Callable[[HttpRequest], HttpResponse] = namespace["receive"]
    return receive


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_the_documented_receiver_answers_401_to_a_malformed_signature(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("time.time", lambda: float(NOW))
    receive = docs_receiver()
    header = MALFORMED[case]
    headers = {} if header is None else {"Webhook-Signature": header}
    request = RequestFactory().post(
        "/hooks/", data=BODY, content_type="application/json", headers=headers
    )
    assert receive(request).status_code == 401
    good = RequestFactory().post(
        "/hooks/", data=BODY, content_type="application/json", headers={"Webhook-Signature": GOOD}
    )
    assert receive(good).status_code == 204
