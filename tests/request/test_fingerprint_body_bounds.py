"""A guarded request never makes the library read more of a body than Django itself would.

Each request streams its body from a generator that counts what was taken from it, so a
200 MiB body is never allocated, and the test sees exactly how many bytes were read.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.test import Client

from django_idempotency.models import IdempotencyRecord
from tests.support.streams import Firehose
from tests.testapp.models import Widget

MiB = 1024 * 1024
HUGE = 200 * MiB

#: The three doors: the decorator, the middleware and the DRF mixin.
GUARDED = ["/plain/hostile/", "/plain/middleware/hostile/", "/api/hostile/"]


def post_stream(
    path: str, body: Firehose, *, content_length: int | None, key: str, content_type: str
):
    """POST through Django's whole WSGI stack with ``body`` as ``wsgi.input``."""
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "CONTENT_TYPE": content_type,
        "HTTP_IDEMPOTENCY_KEY": key,
        "wsgi.input": body,
    }
    if content_length is not None:
        environ["CONTENT_LENGTH"] = str(content_length)
    return Client().request(**environ)


def content_types(path: str) -> list[str]:
    """Raw bytes everywhere; JSON through DRF too, which refuses octet-stream itself."""
    return ["application/json"] if path.startswith("/api/") else ["application/octet-stream"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", GUARDED)
def test_a_huge_body_is_refused_unread(path, key):
    """Content-Length says 200 MiB: Django refuses ``request.body`` before reading it, and so
    does the fingerprint, whatever the view would have done."""
    body = Firehose(HUGE)
    started = time.monotonic()
    response = post_stream(
        path, body, content_length=HUGE, key=key, content_type=content_types(path)[0]
    )
    print(f"\n{path}: {body.taken} bytes read in {time.monotonic() - started:.3f} s")
    assert response.status_code == 400
    assert body.taken == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert not Widget.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", GUARDED)
def test_a_content_length_that_overstates_the_body_is_refused_unread(path, key):
    body = Firehose(10)
    response = post_stream(
        path, body, content_length=HUGE, key=key, content_type=content_types(path)[0]
    )
    assert response.status_code == 400
    assert body.taken == 0
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", GUARDED)
@pytest.mark.parametrize("declared", [1000, None])
def test_a_content_length_that_understates_the_body_is_read_only_as_far_as_it_says(
    path, key, declared
):
    """200 MiB behind ``Content-Length: 1000`` (or none, as chunked): Django's stream ends
    where the header says, so the fingerprint and the view see the same short body."""
    body = Firehose(HUGE)
    response = post_stream(
        path, body, content_length=declared, key=key, content_type="application/octet-stream"
    )
    assert body.taken == (declared or 0) <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if path.startswith("/api/"):  # DRF refuses an octet-stream body with its own 415
        assert response.status_code == (415 if declared else 201)
    else:
        assert response.status_code == 201 and response.json()["bytes"] == (declared or 0)
