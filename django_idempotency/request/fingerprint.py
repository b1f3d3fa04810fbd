"""Request fingerprints: SHA-256 over method, path, canonical query and canonical body.

A retry must carry the same request; formatting is not part of "the same". JSON is re-serialised
with sorted keys and no insignificant whitespace, form fields are sorted, multipart uploads are
hashed file by file as they stream, anything else is hashed as raw bytes. The body itself is
never stored.

Fingerprinting reads no more of a body than Django itself would: a body that is not multipart
is read through ``request.body``, under ``DATA_UPLOAD_MAX_MEMORY_SIZE``, unless the caller
allows a larger one (``max_body``) for a view that reads its stream itself; multipart is parsed
by Django's own parser under its own limits.
"""

from __future__ import annotations

import codecs
import enum
import hashlib
import json
import re
import secrets
from tempfile import SpooledTemporaryFile
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import parse_qsl, urlencode

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, QueryDict
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.utils.datastructures import MultiValueDict

from django_idempotency.core.bounded import Recently

if TYPE_CHECKING:
    from hashlib import _Hash

__all__ = [
    "BodyLimit",
    "DJANGO_LIMIT",
    "canonical_path",
    "hand_over_cleanup",
    "prepare_body",
    "recorded_path",
    "request_fingerprint",
]

_CHUNK = 64 * 1024
#: What decoding a body under a client's declared charset may raise besides a clean
#: UnicodeDecodeError: a codec that is not a text encoding (``charset=base64``), or one that
#: refuses the error handler or any input (``idna``, ``undefined``).
_CHARSET_ERRORS = (LookupError, UnicodeError)
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
#: The longest number the canonical JSON writes out in full; the most digits Python itself
#: reads as an integer (``sys.get_int_max_str_digits()`` by default).
_MAX_DIGITS = 4300


class _BodyLimit(enum.Enum):
    DJANGO = "DATA_UPLOAD_MAX_MEMORY_SIZE"


#: ``max_body``'s default: the bound Django itself puts on ``request.body``, read live from
#: ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE``.
DJANGO_LIMIT: Final = _BodyLimit.DJANGO

#: What ``max_body`` may be: a number of bytes, None for no bound, or :data:`DJANGO_LIMIT`.
BodyLimit = int | None | Literal[_BodyLimit.DJANGO]


def canonical_path(request: HttpRequest) -> str:
    """Path plus the query string with its parameters in sorted order."""
    query = request.META.get("QUERY_STRING", "")
    if not query:
        return request.path
    pairs = sorted(parse_qsl(query, keep_blank_values=True))
    return f"{request.path}?{urlencode(pairs)}"


def recorded_path(request: HttpRequest) -> str:
    """:func:`canonical_path` as the record stores it, control characters percent-encoded.

    Any path a view is routed on reaches the record: PostgreSQL text cannot hold NUL, and CR/LF
    have no place in an admin column. The fingerprint still
    hashes the path itself.
    """
    return _CONTROL_CHARS.sub(lambda char: f"%{ord(char.group()):02X}", canonical_path(request))


def request_fingerprint(request: HttpRequest, *, max_body: BodyLimit = DJANGO_LIMIT) -> str:
    """Hex SHA-256 identifying what the request asks for, independent of body formatting.

    ``max_body`` is the largest body, in bytes, that is not multipart the fingerprint reads; a
    larger one raises ``RequestDataTooBig``, which Django answers with a 400: unread when its
    Content-Length says so, else read no further than Django itself would. By default it is
    Django's own bound on ``request.body``, so a guarded request costs no more than a view
    reading ``request.body``. A view that reads large raw bodies from the stream itself passes a
    larger bound, or None for none: a body above ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is then hashed
    as raw bytes as it streams, and handed back to the view spooled.
    """
    content_type = request.content_type or ""
    if not _charset_decodes(request.encoding):
        # Django's own parsers would raise on this body; its raw bytes still identify the
        # request, and the view answers the client's mistake itself.
        content_type = ""
    if content_type == "multipart/form-data":
        digest = _head(request)
        _hash_multipart(request, digest)
        return digest.hexdigest()
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    bound = limit if max_body is DJANGO_LIMIT else max_body
    if not hasattr(request, "_body"):
        length = _content_length(request)
        _refuse_above(bound, length)
        if limit is not None and length > limit:  # more than Django itself would read
            digest = _head(request)
            _hash_raw_stream(request, digest, bound)
            return digest.hexdigest()
    # Django's own read: it stops past its limit whatever Content-Length claimed, and raises.
    body = request.body
    _refuse_above(bound, len(body))
    if _is_json(content_type):
        # Everything its canonical text depends on, as it came: a retry repeats it byte for byte.
        sent = hashlib.sha256(
            f"{request.method}\0{request.path}\0{request.META.get('QUERY_STRING', '')}\0"
            f"{request.encoding}\0".encode("utf-8", "surrogatepass")
        )
        sent.update(body)
        seen = sent.digest()
        found = _SEEN.get(seen)
        if found is None:
            digest = _head(request)
            digest.update(_canonical_json(body))
            found = digest.hexdigest()
            _SEEN.put(seen, found)
        return found
    digest = _head(request)
    if content_type == "application/x-www-form-urlencoded":
        digest.update(_canonical_form(body, request.encoding))
    else:
        digest.update(b"raw\n" + body)
    return digest.hexdigest()


#: The fingerprints of the JSON requests this process saw last, by a digest of the request as
#: it came (method, path, query string, charset and body): a retry sends the same bytes, so its
#: fingerprint is found here without its body being parsed and written out canonically again,
#: the costliest step of a replay's fingerprint. Digests only: no body, key or scope is kept.
_SEEN: Recently[bytes, str] = Recently(entries=4096)


def _head(request: HttpRequest) -> _Hash:
    """A digest of what the request asks for, its method and path, before its body."""
    return hashlib.sha256(f"{request.method}\n{canonical_path(request)}\n".encode())


def _refuse_above(bound: int | None, size: int) -> None:
    if bound is not None and size > bound:
        raise RequestDataTooBig(
            f"Request body exceeded the {bound} bytes an idempotency fingerprint reads "
            "(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, or the max_body its caller allowed)."
        )


def _charset_decodes(encoding: str | None) -> bool:
    """Whether text can be decoded under the request's charset, as Django's parsers do it."""
    if encoding is None:
        return True
    try:
        b"name=value".decode(encoding)
        b"name=value\xff".decode(encoding, "replace")
    except _CHARSET_ERRORS:
        return False
    return codecs.lookup(encoding)._is_text_encoding


def _canonical_form(body: bytes, encoding: str | None) -> bytes:
    try:
        fields = QueryDict(body, encoding=encoding)
    except _CHARSET_ERRORS:
        return b"raw\n" + body
    return b"form\n" + _canonical_fields(fields)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def _content_length(request: HttpRequest) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


def _fits_in_memory(request: HttpRequest) -> bool:
    """Whether reading ``request.body`` is what Django itself would allow."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return hasattr(request, "_body") or limit is None or _content_length(request) <= limit


def _canonical_json(body: bytes) -> bytes:
    try:
        # json.loads(body) with the decoder made once: it reads bytes exactly this way.
        parsed = _JSON_DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
        text = _JSON_ENCODER.encode(parsed)
    except (ValueError, RecursionError):
        # Not JSON after all, a number Python will not read (an integer or exponent of over
        # 4300 digits) or hostile nesting: the raw bytes still identify the request, and the
        # view answers the client's mistake itself.
        return b"raw\n" + body
    return b"json\n" + _NUMBERS.unquote(text).encode("utf-8", "surrogatepass")


class _ExactNumbers:
    """Numbers for the canonical JSON, compared by exact decimal value, never as floats.

    One text per value, so 1, 1.0, 1.00, 10e-1 and 1e0 are one request, and 0.1 and
    0.10000000000000000001 are two: an integral value is its integer digits, any other its
    plain decimal without trailing zeros (``0.05``). A value with more than ``_MAX_DIGITS``
    digits before or after the point is ``<digits>e<exponent>`` instead, so 1e999999999 is
    never expanded. NaN and (-)Infinity stay as written. Integers written without a fraction
    or exponent are Python's own, read and written by the json module.

    The stdlib encoder cannot write such text unquoted, so each is handed to it as a string
    that starts with a random mark, and ``"<mark>`` is dropped from the encoded text. The mark
    is drawn once per process and never leaves it (only the digest does): a client cannot send
    it, so no string of its own is ever taken for a number. The closing
    quote stays: the text is only hashed, and ``1.5"`` still reads one way (no integer, string
    or literal the encoder writes looks like it).
    """

    def __init__(self) -> None:
        self._mark = secrets.token_hex(8)

    def parse(self, text: str) -> int | str:
        if "e" not in text and "E" not in text and text[-1] != "0" and len(text) <= _MAX_DIGITS:
            return self._wrap(text)  # a plain decimal without trailing zeros: canonical already
        mantissa, _, exponent_text = text.lower().partition("e")
        negative = mantissa.startswith("-")
        whole, _, fraction = mantissa.lstrip("-").partition(".")
        digits = (whole + fraction).lstrip("0")
        significant = digits.rstrip("0")
        if not significant:
            return 0
        exponent = int(exponent_text or 0) - len(fraction) + len(digits) - len(significant)
        sign = "-" if negative else ""
        if exponent >= 0 and len(significant) + exponent <= _MAX_DIGITS:
            return int(f"{sign}{significant}{'0' * exponent}")
        point = len(significant) + exponent  # digits before the decimal point
        if point <= _MAX_DIGITS and -exponent <= _MAX_DIGITS:
            if point > 0:
                return self._wrap(f"{sign}{significant[:point]}.{significant[point:]}")
            return self._wrap(f"{sign}0.{'0' * -point}{significant}")
        return self._wrap(f"{sign}{significant}e{exponent}")

    def constant(self, name: str) -> str:
        return self._wrap(name)

    def unquote(self, text: str) -> str:
        return text.replace(f'"{self._mark}', "")

    def _wrap(self, number: str) -> str:
        return self._mark + number


#: Made once: a decoder and an encoder cost more to build than a small body costs to read. Both
#: are stateless between calls, like the json module's own default ones, so threads share them.
_NUMBERS = _ExactNumbers()
_JSON_DECODER = json.JSONDecoder(parse_float=_NUMBERS.parse, parse_constant=_NUMBERS.constant)
_JSON_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical_fields(fields: QueryDict | MultiValueDict[str, Any]) -> bytes:
    items = sorted((name, fields.getlist(name)) for name in fields)
    return json.dumps(items, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def _hash_multipart(request: HttpRequest, digest: Any) -> None:
    """Field values plus a streamed digest of each file; uploads never sit in memory whole."""
    fields: QueryDict
    files: MultiValueDict[str, Any]
    try:
        if request.method == "POST":
            fields, files = request.POST, request.FILES
        else:
            # Django parses multipart only for POST; parse it here and leave the result where
            # ``request.POST``/``FILES`` (and DRF's form parsing) will find it.
            parser = MultiPartParser(
                request.META, request, request.upload_handlers, request.encoding
            )
            fields, files = parser.parse()
            request._post, request._files = fields, files  # type: ignore[attr-defined]
    except _CHARSET_ERRORS as exc:
        # The stream is spent, so there are no raw bytes to fall back on: answer as Django
        # answers any multipart body it cannot parse, with a 400.
        raise MultiPartParserError(f"Undecodable multipart body: {exc}") from exc
    digest.update(b"multipart\n" + _canonical_fields(fields) + b"\n")
    for name in sorted(files):
        for upload in files.getlist(name):
            file_digest = hashlib.sha256()
            for chunk in upload.chunks(_CHUNK):
                file_digest.update(chunk)
            upload.seek(0)
            digest.update(f"{name}\0{upload.name}\0{upload.size}\0".encode())
            digest.update(file_digest.digest())


def _hash_raw_stream(request: HttpRequest, digest: Any, bound: int | None) -> None:
    """Hash a large body in chunks and put it back, spooled, for the view to read.

    Only for a caller that allowed a body above DATA_UPLOAD_MAX_MEMORY_SIZE (``max_body``):
    ``request.body`` would refuse it where a view that streams the request would not, so the
    body is read as a stream, never past ``bound``, and handed back as a file.
    """
    # The spool outlives this function: the request owns it and closes it with its stream.
    spool = SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE)  # noqa: SIM115
    digest.update(b"raw\n")
    size = 0
    try:
        while chunk := request.read(_CHUNK if bound is None else min(_CHUNK, bound + 1 - size)):
            size += len(chunk)
            _refuse_above(bound, size)
            digest.update(chunk)
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    request._idempotency_cleanup = [spool.close]  # type: ignore[attr-defined]
    # HttpRequest reads from ``_stream``; resetting ``_read_started`` lets the view (or DRF)
    # read the body as if it had never been touched.
    request._stream = spool  # type: ignore[assignment]
    request._read_started = False  # type: ignore[attr-defined]


def prepare_body(request: HttpRequest) -> None:
    """Read and cache a body that fits in memory, before anything else consumes the stream."""
    if request.content_type != "multipart/form-data" and _fits_in_memory(request):
        request.body  # noqa: B018  (the property caches the body on the request)


def hand_over_cleanup(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    """Close what fingerprinting opened (a spooled body) when the server closes the response."""
    for close in getattr(request, "_idempotency_cleanup", ()):
        response._resource_closers.append(close)  # type: ignore[attr-defined]
    request._idempotency_cleanup = []  # type: ignore[attr-defined]
    return response
