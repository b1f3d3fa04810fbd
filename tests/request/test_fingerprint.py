from __future__ import annotations

import contextlib
import json
import threading
import tracemalloc
from decimal import Decimal
from typing import Any

import django
import pytest
from django.core.exceptions import RequestDataTooBig
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.handlers.wsgi import WSGIRequest
from django.core.signals import request_finished
from django.db import close_old_connections
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from django_idempotency.core.bounded import Recently
from django_idempotency.request import fingerprint
from django_idempotency.request.fingerprint import (
    canonical_path,
    hand_over_cleanup,
    recorded_path,
    request_fingerprint,
)
from tests.support.streams import Firehose

factory = RequestFactory()
HUGE = 200 * 1024 * 1024


def json_fp(body: bytes, path: str = "/p/") -> str:
    return request_fingerprint(factory.post(path, body, content_type="application/json"))


def test_json_formatting_and_key_order_do_not_matter():
    assert json_fp(b'{"a": 1, "b": [1, 2]}') == json_fp(b'{\n "b":[1,2],"a":1}')
    assert json_fp(b'{"a": 1}') != json_fp(b'{"a": 2}')
    assert json_fp(b'{"a": 1}') != json_fp(b'{"a": 1}', path="/q/")


def test_method_matters():
    post = factory.post("/p/", b"{}", content_type="application/json")
    patch = factory.patch("/p/", b"{}", content_type="application/json")
    assert request_fingerprint(post) != request_fingerprint(patch)


def test_query_parameters_are_sorted():
    assert canonical_path(factory.get("/p/?b=2&a=1&a=0")) == "/p/?a=0&a=1&b=2"
    assert json_fp(b"{}", "/p/?b=2&a=1") == json_fp(b"{}", "/p/?a=1&b=2")


def test_hostile_json_falls_back_to_raw_bytes():
    nested = b"[" * 100_000 + b"]" * 100_000
    assert json_fp(nested) == json_fp(nested)
    assert json_fp(b'{"a": ') != json_fp(b'{"a":')  # not JSON: bytes count
    assert json_fp(b"\xff\xfe not utf-8") != json_fp(b"\xff\xfe not utf-8!")


def test_form_fields_are_sorted():
    first = factory.post("/p/", "b=2&a=1", content_type="application/x-www-form-urlencoded")
    second = factory.post("/p/", "a=1&b=2", content_type="application/x-www-form-urlencoded")
    assert request_fingerprint(first) == request_fingerprint(second)


def test_multipart_hashes_file_contents_and_leaves_them_readable():
    def upload(content: bytes):
        return factory.post("/p/", {"name": "x", "doc": SimpleUploadedFile("d.txt", content)})

    request = upload(b"hello")
    fingerprint = request_fingerprint(request)
    assert request.FILES["doc"].read() == b"hello"  # rewound for the view
    assert fingerprint == request_fingerprint(upload(b"hello"))
    assert fingerprint != request_fingerprint(upload(b"hellO"))


def test_multipart_patch_is_parsed_for_the_view():
    request = factory.generic(
        "PATCH", "/p/", _multipart({"name": "x"}, ("doc", "d.bin", b"data")),
        content_type="multipart/form-data; boundary=BoUnDaRy",
    )  # fmt: skip
    request_fingerprint(request)
    assert request.POST["name"] == "x"
    assert request.FILES["doc"].read() == b"data"


def _multipart(fields: dict[str, str], file: tuple[str, str, bytes]) -> bytes:
    lines = []
    for name, value in fields.items():
        lines += [b"--BoUnDaRy", f'Content-Disposition: form-data; name="{name}"'.encode(), b"",
                  value.encode()]  # fmt: skip
    field, filename, content = file
    lines += [
        b"--BoUnDaRy",
        f'Content-Disposition: form-data; name="{field}"; filename="{filename}"'.encode(),
        b"Content-Type: application/octet-stream",
        b"",
        content,
        b"--BoUnDaRy--",
        b"",
    ]
    return b"\r\n".join(lines)


def test_charsets_that_cannot_decode_text_fall_back_to_raw_bytes():
    for charset in ("base64", "undefined", "idna", "punycode"):
        for content_type, body in (
            ("application/x-www-form-urlencoded", b"name=w\xff"),
            ("multipart/form-data; boundary=BoUnDaRy", _multipart({"a": "b"}, ("f", "f", b"x"))),
        ):
            declared = f"{content_type}; charset={charset}"
            request = factory.generic("POST", "/p/", body, content_type=declared)
            again = factory.generic("POST", "/p/", body, content_type=declared)
            other = factory.generic("POST", "/p/", body + b"!", content_type=declared)
            assert request_fingerprint(request) == request_fingerprint(again), charset
            assert request_fingerprint(request) != request_fingerprint(other), charset


def test_recorded_path_percent_encodes_control_characters():
    request = factory.post("/p/a\x00b\x1b\x7f/?q=%00")
    assert recorded_path(request) == "/p/a%00b%1B%7F/?q=%00"
    assert request_fingerprint(request) != request_fingerprint(factory.post("/p/a%00b%1B%7F/"))


# --- bytes read: never more than Django itself would read -----------------------------------------


def streamed(
    body: Firehose,
    content_length: int | None,
    content_type: str = "application/octet-stream",
    *,
    cut_at_content_length: bool = True,
) -> WSGIRequest:
    """A POST whose body is ``body``. Under WSGI Django cuts the stream at Content-Length; other
    servers may hand Django a stream that runs on (``cut_at_content_length=False``)."""
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/p/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "CONTENT_TYPE": content_type,
        "wsgi.url_scheme": "http",
        "wsgi.input": body,
    }
    if content_length is not None:
        environ["CONTENT_LENGTH"] = str(content_length)
    request = WSGIRequest(environ)
    if not cut_at_content_length:
        request._stream = body
    return request


def finish(request: WSGIRequest) -> None:
    """Close the response as the server would, which closes what the fingerprint spooled.

    Closing a response sends ``request_finished``; as Django's own test client does, the
    database connections are left alone (a test without the database may not touch one that
    an earlier test of the process opened)."""
    request_finished.disconnect(close_old_connections)
    try:
        hand_over_cleanup(request, HttpResponse()).close()
    finally:
        request_finished.connect(close_old_connections)


def read_back(request: WSGIRequest) -> bytes:
    """What the view reads after the fingerprint, then what the server closes with it."""
    body = request.read()
    finish(request)
    return body


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
@pytest.mark.parametrize(
    "content_type", ["application/octet-stream", "application/json", "text/plain; charset=utf-8",
                     "application/x-www-form-urlencoded"],
)  # fmt: skip
@pytest.mark.parametrize("content_length", [HUGE, 1001])
def test_a_body_over_djangos_limit_is_refused_unread(content_type, content_length):
    body = Firehose(content_length)
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(streamed(body, content_length, content_type))
    assert body.taken == 0


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_a_content_length_that_overstates_the_body_is_refused_unread():
    body = Firehose(10)
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(streamed(body, HUGE))
    assert body.taken == 0


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_a_content_length_that_understates_the_body_is_read_no_further_than_django_reads():
    cut = Firehose(HUGE)
    request = streamed(cut, 10)
    fingerprint = request_fingerprint(request)
    assert cut.taken == 10
    assert read_back(request) == b"x" * 10  # the view reads what was hashed
    assert fingerprint == request_fingerprint(streamed(Firehose(10), 10))
    # A stream that runs on past its Content-Length: the fingerprint reads no more of it than
    # Django's own request.body does (Django 5.2 stops one byte past its limit; 6.1 reads on),
    # and refuses a body over the limit however it arrived.
    django_alone, running_on = Firehose(5_000_000), Firehose(5_000_000)
    with contextlib.suppress(RequestDataTooBig):
        streamed(django_alone, 10, cut_at_content_length=False).body  # noqa: B018
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(streamed(running_on, 10, cut_at_content_length=False))
    assert running_on.taken == django_alone.taken
    assert running_on.taken == 1001 or django.VERSION >= (6,)


def streamed_fingerprint(body: Firehose, **kwargs: int | None) -> str:
    """The fingerprint of ``body`` sent with an honest Content-Length; spool closed after."""
    request = streamed(body, body.size)
    fingerprint = request_fingerprint(request, **kwargs)
    finish(request)
    return fingerprint


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000, FILE_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_a_caller_whose_view_streams_the_body_lifts_the_bound():
    size = 5_000_000
    request = streamed(Firehose(size), size)
    fingerprint = request_fingerprint(request, max_body=None)
    assert read_back(request) == b"x" * size  # handed back, spooled, from its first byte
    assert fingerprint == streamed_fingerprint(Firehose(size), max_body=size)
    assert fingerprint != streamed_fingerprint(Firehose(size, b"y"), max_body=None)
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=None):
        # Read in memory or streamed, the same bytes are the same request.
        assert fingerprint == streamed_fingerprint(Firehose(size))


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_max_body_bounds_a_streamed_body_whatever_its_content_length_says():
    honest = Firehose(20_000)
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(streamed(honest, 20_000), max_body=10_000)
    assert honest.taken == 0
    lying = Firehose(HUGE)
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(streamed(lying, 5000, cut_at_content_length=False), max_body=10_000)
    assert lying.taken == 10_001


def test_max_body_below_djangos_limit_is_honoured():
    request = factory.post("/p/", b"[" + b"1," * 1000 + b"1]", content_type="application/json")
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(request, max_body=1000)
    assert request_fingerprint(request, max_body=None)


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000, FILE_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_multipart_streams_files_past_the_limit_but_not_fields():
    """Django's multipart parser counts fields, not files, against DATA_UPLOAD_MAX_MEMORY_SIZE."""
    upload = factory.post("/p/", {"name": "x", "doc": SimpleUploadedFile("d", b"z" * 50_000)})
    assert request_fingerprint(upload)
    with upload.FILES["doc"] as doc:
        assert doc.read() == b"z" * 50_000
    fields = factory.post("/p/", {"name": "x" * 5000})
    with pytest.raises(RequestDataTooBig):
        request_fingerprint(fields)


# --- numbers: exact decimal values, never floats ------------------------------------------------

#: Reproducible and quick: no example database, no deadline on a shared machine.
properties = settings(max_examples=300, deadline=None, database=None, derandomize=True)


def test_numbers_that_one_float_would_hold_are_different_requests():
    assert json_fp(b"[12345678901234567.89]") != json_fp(b"[12345678901234568.00]")
    assert json_fp(b"[0.1]") != json_fp(b"[0.10000000000000000001]")
    assert json_fp(b"[9007199254740993]") != json_fp(b"[9007199254740992.0]")
    assert json_fp(b"[1e400]") != json_fp(b"[1e401]")  # both infinite as floats


def test_numerically_equal_numbers_are_one_request():
    same = [b"1", b"1.0", b"1.00", b"1e0", b"1E+0", b"10e-1", b"0.1e1", b"100E-2", b"1e000"]
    assert len({json_fp(b"[%s]" % number) for number in same}) == 1
    zeros = [b"0", b"-0", b"0.0", b"-0.0", b"0e5", b"-0E-9"]
    assert len({json_fp(b"[%s]" % number) for number in zeros}) == 1
    assert json_fp(b"[0.05]") == json_fp(b"[5e-2]") == json_fp(b"[0.0500]")
    assert json_fp(b"[-12.5]") == json_fp(b"[-1.25e1]") != json_fp(b"[12.5]")


def test_numbers_are_never_strings_and_literals_stay_as_written():
    assert json_fp(b"[1.5]") != json_fp(b'["1.5"]')
    assert json_fp(b"[1]") != json_fp(b'["1"]')
    assert json_fp(b"[NaN]") == json_fp(b"[ NaN ]")
    literals = [b"NaN", b"Infinity", b"-Infinity", b'"NaN"', b"null", b"1e999999999"]
    assert len({json_fp(b"[%s]" % literal) for literal in literals}) == len(literals)


def test_huge_exponents_are_never_expanded():
    spellings = [b"1e999999999", b"10E+999999998", b"1.0e999999999", b"0.1e1000000000"]
    tracemalloc.start()
    try:
        fingerprints = {json_fp(b'{"x": %s}' % number) for number in spellings}
        json_fp(b"[1e-999999999, -2.5e99999999999999999999, 1e99999999999999999999999]")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # 10**999999999 alone would take 415 MB
    assert len(fingerprints) == 1
    assert json_fp(b"[1e999999999]") != json_fp(b"[1e999999998]")
    assert json_fp(b"[1e-999999999]") != json_fp(b"[-1e-999999999]")


def test_long_numbers_compare_exactly_on_both_sides_of_the_written_out_limit():
    """Up to 4300 digits before or after the point a number is written out, beyond it as
    ``<digits>e<exponent>``: either way each value has one form."""
    for places in (4299, 4300, 4301):
        written_out = b"0." + b"0" * (places - 1) + b"1"
        assert json_fp(b"[%s]" % written_out) == json_fp(b"[1e-%d]" % places), places
        assert json_fp(b"[%s]" % written_out) != json_fp(b"[1e-%d]" % (places + 1)), places
    for digits in (4300, 4301):
        integral = b"1" + b"0" * (digits - 1) + b".0"
        assert json_fp(b"[%s]" % integral) == json_fp(b"[1e%d]" % (digits - 1)), digits
    assert json_fp(b"[1" + b"0" * 4299 + b"]") == json_fp(b"[1e4299]")


@pytest.fixture
def seen_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every JSON body written out canonically: no fingerprint found among those seen."""
    monkeypatch.setattr(fingerprint, "_SEEN", Recently(entries=0))


@pytest.fixture
def canonical_texts(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bodies whose canonical JSON is written, in order."""
    written: list[bytes] = []
    canonical_json = fingerprint._canonical_json

    def counted(body: bytes) -> bytes:
        written.append(body)
        return canonical_json(body)

    monkeypatch.setattr(fingerprint, "_SEEN", Recently(entries=16))
    monkeypatch.setattr(fingerprint, "_canonical_json", counted)
    return written


def test_a_retry_is_fingerprinted_from_the_bytes_it_repeats(canonical_texts: list[bytes]):
    """A body seen before, under the same method, path, query and charset, is not parsed and
    written out again; any difference in what was sent is a new canonical text."""
    body = b'{"amount": 12.50, "b": [1, 2]}'
    first = json_fp(body)
    assert json_fp(body) == first
    assert canonical_texts == [body]
    reordered = b'{"b":[1,2],"amount":12.5}'
    assert json_fp(reordered) == first
    assert json_fp(body, path="/p/?a=1") != first
    patch = factory.patch("/p/", body, content_type="application/json")
    assert request_fingerprint(patch) != first
    latin = factory.post("/p/", body, content_type="application/json; charset=latin-1")
    assert request_fingerprint(latin) == first  # JSON detects its own encoding
    assert canonical_texts == [body, reordered, body, body, body]


def test_fingerprints_seen_are_digests_and_bounded(monkeypatch: pytest.MonkeyPatch):
    """What is kept is a digest of each request, never its body, and never more than the
    bound: a full table starts again empty."""
    seen: Recently[bytes, str] = Recently(entries=2)
    monkeypatch.setattr(fingerprint, "_SEEN", seen)
    for number in range(5):
        card = b'{"card": "4242 4242 4242 %04d"}' % number
        assert json_fp(card) == json_fp(card)
        assert 1 <= len(seen) <= 2
    assert all(len(sent) == 32 and b"4242" not in sent for sent in seen._items)
    assert all(len(found) == 64 for found in seen._items.values())


def test_a_table_of_no_entries_keeps_nothing():
    nothing: Recently[str, int] = Recently(entries=0)
    nothing.put("a", 1)
    assert "a" not in nothing and nothing.get("a") is None and len(nothing) == 0


@pytest.mark.usefixtures("seen_nothing")
def test_threads_sharing_the_canonical_json_reader_get_one_answer():
    """The JSON decoder and encoder are made once per process and shared by every thread."""
    body = json.dumps({"amount": 12.50, "rate": 1e-3, "n": [1.0, 2, "2.0"], "x": "NaN"})
    expected = json_fp(body.encode())
    answers: set[str] = set()
    barrier = threading.Barrier(8)

    def fingerprint_many() -> None:
        barrier.wait()
        answers.update(json_fp(body.encode()) for _ in range(200))

    threads = [threading.Thread(target=fingerprint_many) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {expected}


def test_numbers_python_will_not_read_fall_back_to_raw_bytes():
    """Integers (or exponents) of over 4300 digits: the exact bytes are the request."""
    for huge in (b"[" + b"9" * 5000 + b"]", b"[1e" + b"9" * 5000 + b"]"):
        assert json_fp(huge) == json_fp(huge)
        assert json_fp(huge) != json_fp(huge.replace(b"[", b"[ "))


def spellings_of(value: Decimal) -> st.SearchStrategy[str]:
    """JSON texts for ``value``: trailing zeros, any exponent, either case, signs and padding."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    minus = "-" if sign else ""

    @st.composite
    def spelling(draw: Any) -> str:
        padding = draw(st.integers(0, 3))
        coefficient = "".join(map(str, digits)).lstrip("0") + "0" * padding
        if not coefficient.strip("0"):
            zero = draw(st.sampled_from(["0", "0.0", "0e0", "0.000E-7", "0e+12"]))
            return draw(st.sampled_from(["", "-"])) + zero
        scale = exponent - padding  # value = coefficient * 10**scale
        if draw(st.booleans()) and -40 < scale < 40:  # plain decimal notation
            if scale >= 0:
                return minus + coefficient + "0" * scale
            whole, fraction = coefficient[:scale] or "0", coefficient[scale:]
            return f"{minus}{whole}.{fraction.rjust(-scale, '0')}"
        point = draw(st.integers(1, len(coefficient)))  # d.ddd e<x>
        fraction = coefficient[point:]
        mantissa = coefficient[:point] + (f".{fraction}" if fraction else "")
        shown = scale + len(coefficient) - point
        marker = draw(st.sampled_from(["e", "E"]))
        plus = "+" if shown >= 0 and draw(st.booleans()) else ""
        return f"{minus}{mantissa}{marker}{plus}{shown:0{draw(st.integers(1, 4))}d}"

    return spelling()


decimals = st.decimals(allow_nan=False, allow_infinity=False)


@properties
@given(st.data(), decimals, decimals)
def test_numbers_are_one_request_exactly_when_they_are_equal(data, a, b):
    first = data.draw(spellings_of(a))
    again = data.draw(spellings_of(a))
    other = data.draw(spellings_of(b))
    assert Decimal(first) == Decimal(again) == a and Decimal(other) == b  # the test's own check
    assert json_fp(f"[{first}]".encode()) == json_fp(f"[{again}]".encode()), (first, again)
    same = json_fp(f"[{first}]".encode()) == json_fp(f"[{other}]".encode())
    assert same == (a == b), (first, other)


documents = st.recursive(
    st.none() | st.booleans() | decimals | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def formatted(data: Any, value: Any) -> str:
    """``value`` as JSON with whitespace, key order, string escapes and numbers drawn at random."""
    space = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])

    def string(text: str) -> str:
        return json.dumps(text, ensure_ascii=data.draw(st.booleans()))

    if isinstance(value, dict):
        keys = data.draw(st.permutations(sorted(value)))
        members = [
            f"{data.draw(space)}{string(key)}{data.draw(space)}:{formatted(data, value[key])}"
            for key in keys
        ]
        return "{" + ",".join(members) + data.draw(space) + "}"
    if isinstance(value, list):
        return "[" + ",".join(formatted(data, item) for item in value) + data.draw(space) + "]"
    if isinstance(value, Decimal):
        return data.draw(space) + data.draw(spellings_of(value))
    if isinstance(value, str):
        return data.draw(space) + string(value)
    return data.draw(space) + json.dumps(value)


@properties
@given(st.data(), documents)
def test_formatting_never_changes_the_request(data, document):
    first = formatted(data, document).encode()
    second = formatted(data, document).encode()
    assert json_fp(first) == json_fp(second), (first, second)
