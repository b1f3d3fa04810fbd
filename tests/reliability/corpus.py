"""Known nasties: Idempotency-Key values, bodies, content types and methods that break servers.

The hypothesis tests explore around these; the corpus pins the cases that must always be tried,
whatever the random draw. Header values are given as WSGI sees them (``str``, one character per
byte as latin-1) for Django's test client, and as raw bytes for the socket tests against gunicorn.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings

from django_idempotency.request.keys import MAX_KEY_LENGTH


def bounded(max_examples: int, *, stateful_step_count: int | None = None) -> settings:
    """Hypothesis settings for this suite: bounded, reproducible, no example database.

    ``RELIABILITY_EXAMPLES_SCALE`` (a float, default 1) multiplies the examples for a deeper run
    on a developer's machine; CI runs the default.
    """
    scale = float(os.environ.get("RELIABILITY_EXAMPLES_SCALE", "1"))
    extra = {} if stateful_step_count is None else {"stateful_step_count": stateful_step_count}
    return settings(
        max_examples=max(1, int(max_examples * scale)),
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=False,
        # The database fixtures are per test, not per example: every example uses its own keys
        # and checks the invariants on the whole table, so sharing the database is the point.
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
        **extra,  # type: ignore[arg-type]
    )


# --- Idempotency-Key values -----------------------------------------------------------------


@dataclass(frozen=True)
class KeyCase:
    name: str
    #: The header value as the test client passes it (``HTTP_IDEMPOTENCY_KEY``).
    raw: str
    #: The key the library must store, or ``None`` when it must answer 400 and store nothing.
    key: str | None


PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ',"\\')

KEYS: list[KeyCase] = [
    # accepted
    KeyCase("one-char", "k", "k"),
    KeyCase("longest", "k" * MAX_KEY_LENGTH, "k" * MAX_KEY_LENGTH),
    KeyCase("uuid", "8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    KeyCase("sf-string", '"8e03978e"', "8e03978e"),
    KeyCase("sf-string-space", '"with space"', "with space"),
    KeyCase("sf-string-escapes", r'"esc\"aped\\"', 'esc"aped\\'),
    KeyCase("outer-whitespace", " \t padded \t ", "padded"),
    KeyCase("all-printable", PRINTABLE, PRINTABLE),
    KeyCase("percent-literal", "%00%0d%0a", "%00%0d%0a"),
    KeyCase("markup", "<script>alert(1)</script>", "<script>alert(1)</script>"),
    KeyCase("jndi", "${jndi:ldap://127.0.0.1/a}", "${jndi:ldap://127.0.0.1/a}"),
    KeyCase(
        "sql",
        '"\'; DROP TABLE django_idempotency_idempotencyrecord; --"',
        "'; DROP TABLE django_idempotency_idempotencyrecord; --",
    ),
    KeyCase("format-string", "%s%s%s%n{0}{key}", "%s%s%s%n{0}{key}"),
    # refused: 400 idempotency_key_invalid, nothing stored
    KeyCase("empty", "", None),
    KeyCase("blank", "   ", None),
    KeyCase("tab-only", "\t", None),
    KeyCase("empty-sf-string", '""', None),
    KeyCase("too-long", "k" * (MAX_KEY_LENGTH + 1), None),
    KeyCase("too-long-sf-string", '"' + "k" * (MAX_KEY_LENGTH + 1) + '"', None),
    KeyCase("very-long", "k" * 100_000, None),
    KeyCase("megabyte", "k" * 1_000_000, None),
    KeyCase("latin-1", "caf\xe9", None),
    KeyCase("utf-8-as-latin-1", "caf\xc3\xa9", None),
    KeyCase("bmp", "\u2603\u2603", None),
    KeyCase("astral", "\U0001f600", None),
    KeyCase("lone-surrogate", "a\ud800b", None),
    KeyCase("rtl-override", "abc\u202edcb", None),
    KeyCase("zero-width", "a\u200bb", None),
    KeyCase("nul", "\x00", None),
    KeyCase("nul-inside", "a\x00b", None),
    KeyCase("crlf-injection", "a\r\nX-Injected: 1", None),
    KeyCase("crlf-response-split", "a\r\n\r\nHTTP/1.1 200 OK", None),
    KeyCase("bare-cr", "a\rb", None),
    KeyCase("bare-lf", "a\nb", None),
    KeyCase("vertical-tab", "a\x0bb", None),
    KeyCase("escape-sequence", "a\x1b[31mred", None),
    KeyCase("del", "a\x7fb", None),
    KeyCase("c1-control", "a\x85b", None),
    KeyCase("inner-space", "a b", None),
    KeyCase("sent-twice", "a,b", None),
    KeyCase("sent-twice-same", "k, k", None),
    KeyCase("two-sf-strings", '"a", "b"', None),
    KeyCase("unterminated", '"abc', None),
    KeyCase("trailing-garbage", '"abc"x', None),
    KeyCase("bad-escape", r'"a\nb"', None),
    KeyCase("backslash-bare", "a\\b", None),
    KeyCase("padded-inside-quotes", '" padded "', None),
    KeyCase("nul-in-sf-string", '"a\x00b"', None),
    KeyCase("crlf-in-sf-string", '"a\r\nb"', None),
]


# --- bodies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BodyCase:
    name: str
    body: bytes
    content_type: str | None


BOUNDARY = "hostileBoundary7MA4YWxkTrZu0gW"


def multipart(
    parts: list[tuple[str, bytes, str | None]], boundary: str = BOUNDARY, *, close: bool = True
) -> bytes:
    """A multipart body by hand: (field name, content, file name or None)."""
    lines: list[bytes] = []
    for name, content, filename in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        lines += [f"--{boundary}".encode(), f"Content-Disposition: {disposition}".encode()]
        if filename is not None:
            lines.append(b"Content-Type: application/octet-stream")
        lines += [b"", content]
    if close:
        lines.append(f"--{boundary}--".encode())
    return b"\r\n".join(lines) + b"\r\n"


MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
TEN_MB = 10 * 1024 * 1024
DEPTH = 100_000
_GOOD_MULTIPART = multipart([("name", b"w", None), ("file", b"\x00\xff" * 1000, "a.bin")])

BODIES: list[BodyCase] = [
    BodyCase("json", b'{"name": "w"}', JSON),
    BodyCase("json-reformatted", b'{\n  "name" :"w"\n}', JSON),
    BodyCase("empty-json", b"", JSON),
    BodyCase("empty-no-type", b"", None),
    BodyCase("json-scalar", b"42", JSON),
    BodyCase("json-list", b"[1, 2, 3]", JSON),
    BodyCase("json-truncated", b'{"name": ', JSON),
    BodyCase("json-garbage", b"{]}{", JSON),
    BodyCase("json-trailing", b'{"name": "w"} trailing', JSON),
    BodyCase("json-nan", b'{"x": NaN, "y": Infinity}', JSON),
    BodyCase("json-huge-exponent", b'{"x": 1e999999}', JSON),
    BodyCase("json-huge-integer", b'{"x": ' + b"9" * 5000 + b"}", JSON),
    BodyCase("json-lone-surrogate", b'{"x": "\\ud800"}', JSON),
    BodyCase("json-nul-escape", b'{"x": "a\\u0000b", "\\u0000": 1}', JSON),
    BodyCase("json-duplicate-keys", b'{"a": 1, "a": 2}', JSON),
    BodyCase("json-utf8-bom", b'\xef\xbb\xbf{"name": "w"}', JSON),
    BodyCase("json-utf16", '{"name": "w"}'.encode("utf-16"), JSON),
    BodyCase("json-not-utf8", b'{"name": "\xff\xfe\xc3\x28"}', JSON),
    BodyCase("json-deep-arrays", b"[" * DEPTH + b"]" * DEPTH, JSON),
    BodyCase("json-deep-objects", b'{"a":' * DEPTH + b"1" + b"}" * DEPTH, JSON),
    BodyCase("json-deep-unclosed", b"[" * DEPTH, JSON),
    BodyCase("json-deep-just-under", b"[" * 900 + b"]" * 900, JSON),
    BodyCase("json-10mb", b'{"name": "' + b"x" * TEN_MB + b'"}', JSON),
    BodyCase("json-suffix-type", b'{"name": "w"}', "application/vnd.api+json"),
    BodyCase("json-charset-utf16", b'{"name": "w"}', "application/json; charset=utf-16"),
    BodyCase("json-charset-not-text", b'{"name": "w"}', "application/json; charset=base64"),
    BodyCase("json-charset-unknown", b'{"name": "w"}', "application/json; charset=nonesuch"),
    BodyCase("gzip-as-json", gzip.compress(b'{"name": "w"}'), JSON),
    BodyCase("gzip", gzip.compress(b"x" * 100_000), "application/gzip"),
    BodyCase("gzip-bomb-like", gzip.compress(b"\x00" * 5_000_000), "application/octet-stream"),
    BodyCase("binary-10mb", bytes(range(256)) * (TEN_MB // 256), "application/octet-stream"),
    BodyCase("not-utf8-text", b"\xff\xfe\xfd\x80\x81", "text/plain; charset=utf-8"),
    BodyCase("nul-bytes", b"\x00" * 1024, "text/plain"),
    BodyCase("form", b"name=w&b=2&b=1", FORM),
    BodyCase("form-bad-percent", b"name=%ZZ&%=%%", FORM),
    BodyCase("form-not-utf8", b"name=%ff%fe&\xff=\xfe", FORM),
    BodyCase("form-too-many-fields", "&".join(f"f{i}=1" for i in range(5000)).encode(), FORM),
    BodyCase("form-charset-not-text", b"name=w", FORM + "; charset=base64"),
    BodyCase("form-charset-utf16", b"name=w", FORM + "; charset=utf-16"),
    BodyCase("form-charset-undefined", b"name=w", FORM + "; charset=undefined"),
    BodyCase("form-charset-idna", b"name=w\xff", FORM + "; charset=idna"),
    BodyCase("form-charset-punycode", b"name=w", FORM + "; charset=punycode"),
    BodyCase("form-10mb", b"name=" + b"x" * TEN_MB, FORM),
    BodyCase("multipart", _GOOD_MULTIPART, MULTIPART),
    BodyCase("multipart-no-boundary", _GOOD_MULTIPART, "multipart/form-data"),
    BodyCase("multipart-empty-boundary", _GOOD_MULTIPART, "multipart/form-data; boundary="),
    BodyCase(
        "multipart-wrong-boundary", _GOOD_MULTIPART, "multipart/form-data; boundary=notTheOne"
    ),
    BodyCase(
        "multipart-boundary-too-long",
        multipart([("name", b"w", None)], "b" * 200),
        "multipart/form-data; boundary=" + "b" * 200,
    ),
    BodyCase(
        "multipart-boundary-not-ascii",
        _GOOD_MULTIPART,
        "multipart/form-data; boundary=caf\xe9",
    ),
    BodyCase("multipart-unterminated", multipart([("name", b"w", None)], close=False), MULTIPART),
    BodyCase("multipart-truncated", _GOOD_MULTIPART[: len(_GOOD_MULTIPART) // 2], MULTIPART),
    BodyCase("multipart-garbage", b"\x00\xff" * 5000, MULTIPART),
    BodyCase(
        "multipart-no-disposition",
        f"--{BOUNDARY}\r\nX: y\r\n\r\nvalue\r\n--{BOUNDARY}--\r\n".encode(),
        MULTIPART,
    ),
    BodyCase(
        "multipart-nasty-names",
        multipart([("a\x00b", b"v", None), ("f", b"data", "../../etc/passwd\x00.png")]),
        MULTIPART,
    ),
    BodyCase(
        "multipart-too-many-fields",
        multipart([(f"f{i}", b"1", None) for i in range(2000)]),
        MULTIPART,
    ),
    BodyCase(
        "multipart-10mb-file",
        multipart([("name", b"w", None), ("file", b"\x00" * TEN_MB, "big.bin")]),
        MULTIPART,
    ),
    BodyCase("multipart-charset-not-text", _GOOD_MULTIPART, MULTIPART + "; charset=base64"),
    BodyCase("multipart-charset-undefined", _GOOD_MULTIPART, MULTIPART + "; charset=undefined"),
    BodyCase("multipart-charset-idna", _GOOD_MULTIPART, MULTIPART + "; charset=idna"),
    BodyCase("json-charset-undefined", b'{"name": "w"}', JSON + "; charset=undefined"),
    BodyCase("multipart-mixed", _GOOD_MULTIPART, f"multipart/mixed; boundary={BOUNDARY}"),
    BodyCase("content-type-garbage", b'{"name": "w"}', "application/json;;;=;\x00"),
    BodyCase("content-type-long", b'{"name": "w"}', "application/json; x=" + "y" * 10_000),
    BodyCase("content-type-not-ascii", b'{"name": "w"}', "application/j\xe9son"),
    BodyCase("xml", b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "b">]><x>&a;</x>', "text/xml"),
]

#: Methods for the test client. Django upper-cases REQUEST_METHOD, so ``post`` is also POST.
METHODS = ["POST", "PATCH", "PUT", "DELETE", "PROPFIND", "TRACE", "MKCOL", "X-CUSTOM", "OPTIONS"]


def json_body(**values: object) -> bytes:
    return json.dumps(values).encode()


# --- paths (the middleware guards by path before any URL pattern is matched) -----------------

#: Suffixes after ``/plain/middleware/hostile/``: the middleware claims the key before URL
#: resolution, so whatever the path holds reaches the record.
PATH_SUFFIXES = [
    "",
    "%00",
    "a%00b/",
    "%0d%0aX-Injected:%201",
    "%ff%fe",
    "caf%C3%A9/",
    "%E2%98%83/",
    "..%2f..%2fetc%2fpasswd",
    "x" * 4000,
    "?a=%00&b=%ff",
    "?%zz=%",
    "?" + "&".join(f"q{i}={i}" for i in range(3000)),
    "?a=1&a=2&A=0&%00=%00",
]


# --- raw requests for gunicorn: what Django's test client cannot express ---------------------


@dataclass(frozen=True)
class RawCase:
    name: str
    #: Header lines as sent, without the request line, Host, Connection and Content-Length.
    headers: list[bytes]
    #: The key the record must hold (the request is answered 2xx); ``None``: no record at all.
    key: str | None
    #: With no key: ``refused`` (a 4xx, from gunicorn or the library) or ``unguarded`` (the
    #: view's own answer; the method or path is not guarded).
    refusal: str = "refused"
    #: The status a stored request answers with.
    status: int = 201
    method: bytes = b"POST"
    path: bytes = b"/plain/middleware/hostile/"
    body: bytes = b'{"name": "w"}'
    #: Whether to add Content-Length for the body.
    content_length: bool = True


def _key(value: bytes) -> bytes:
    return b"Idempotency-Key: " + value


RAW: list[RawCase] = [
    RawCase("plain", [_key(b"raw-plain")], "raw-plain"),
    RawCase("crlf-injected-header", [_key(b"raw-a\r\nX-Injected: 1")], "raw-a"),
    RawCase("bare-lf", [_key(b"raw-b\nX-Injected: 1")], None),
    RawCase("bare-cr", [_key(b"raw-c\rX-Injected: 1")], None),
    RawCase("obs-fold", [_key(b"raw-d\r\n continued")], None),
    # The blank line ends the headers: what follows is body, the key is what came before it.
    RawCase("response-splitting", [_key(b"raw-e\r\n\r\nGET / HTTP/1.1")], "raw-e"),
    RawCase("nul", [_key(b"raw\x00f")], None),
    RawCase("del", [_key(b"raw\x7fg")], None),
    RawCase("escape", [_key(b"raw\x1b[31mh")], None),
    RawCase("tab-inside", [_key(b"raw\ti")], None),
    RawCase("utf-8", [_key("caf\u00e9".encode())], None),
    RawCase("latin-1", [_key(b"caf\xe9")], None),
    RawCase("invalid-utf-8", [_key(b"\xff\xfe\xfd")], None),
    RawCase("empty", [_key(b"")], None),
    RawCase("spaces-only", [_key(b"   ")], None),
    RawCase("sent-twice", [_key(b"raw-j"), _key(b"raw-k")], None),
    RawCase("sent-twice-same", [_key(b"raw-l"), _key(b"raw-l")], None),
    RawCase("underscore-name", [b"Idempotency_Key: raw-m"], None),
    RawCase("lower-case-name", [b"idempotency-key: raw-n"], "raw-n"),
    RawCase("space-before-colon", [b"Idempotency-Key : raw-o"], None),
    RawCase("too-long-for-the-library", [_key(b"k" * 8000)], None),
    RawCase("too-long-for-the-server", [_key(b"k" * 20_000)], None),
    RawCase("sf-string", [_key(b'"raw p"')], "raw p"),
    RawCase("sf-string-crlf", [_key(b'"raw\r\nq"')], None),
    RawCase("lower-case-method", [_key(b"raw-r")], None, method=b"post"),
    RawCase("odd-method", [_key(b"raw-s")], None, "unguarded", method=b"PROPFIND"),
    # The middleware claims only a path that resolves to a view: Django's 404, and no record.
    RawCase("nul-in-path", [_key(b"raw-t")], None, "unguarded", path=b"/plain/middleware/x%00"),
    RawCase("crlf-in-path", [_key(b"raw-u")], None, "unguarded", path=b"/plain/middleware/x%0d%0a"),
    RawCase("raw-utf-8-path", [_key(b"raw-v")], None, path="/plain/middleware/\u2603/".encode()),
    RawCase("raw-latin-1-path", [_key(b"raw-w")], None, path=b"/plain/middleware/\xe9/"),
    RawCase("nul-in-query", [_key(b"raw-x")], "raw-x", path=b"/plain/middleware/hostile/?a=%00"),
    RawCase(
        "chunked",
        [_key(b"raw-y"), b"Transfer-Encoding: chunked", b"Content-Type: application/json"],
        "raw-y",
        body=b'd\r\n{"name": "w"}\r\n0\r\n\r\n',
        content_length=False,
    ),
    RawCase(
        "chunked-and-length",
        [_key(b"raw-z"), b"Transfer-Encoding: chunked", b"Content-Length: 3"],
        None,
        body=b'd\r\n{"name": "w"}\r\n0\r\n\r\n',
        content_length=False,
    ),
    RawCase(
        "bad-content-length",
        [_key(b"raw-0"), b"Content-Length: banana"],
        None,
        content_length=False,
    ),
    RawCase(
        "two-content-lengths",
        [_key(b"raw-1"), b"Content-Length: 13", b"Content-Length: 2"],
        None,
        content_length=False,
    ),
    RawCase(
        "content-type-crlf",
        [_key(b"raw-2"), b"Content-Type: application/json\r\nX-Injected: 1"],
        "raw-2",
    ),
    RawCase("content-type-nul", [_key(b"raw-3"), b"Content-Type: application/json\x00x"], None),
    RawCase("many-headers", [_key(b"raw-4"), *(f"X-H{i}: {i}".encode() for i in range(120))], None),
]
