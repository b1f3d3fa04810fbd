"""IdempotentBrowsableAPIRenderer: DRF's browsable page, plus the Idempotency-Key field and its
script on the pages of views that guard a method they allow, and nothing on the others. (The
field at work, in a browser: tests/demo/test_browsable_api.py.)"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import override_settings
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from django_idempotency.drf import IdempotencyMixin
from django_idempotency.drf.browsable import IdempotentBrowsableAPIRenderer

pytestmark = pytest.mark.django_db


class GuardedView(IdempotencyMixin, APIView):
    renderer_classes = [IdempotentBrowsableAPIRenderer]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})

    def post(self, request: Any) -> Response:  # pragma: no cover - only its form is shown
        return Response({"ok": True}, status=201)


class PutGuardedView(GuardedView):
    idempotent_methods = ("POST", "PUT", "DELETE")

    def put(self, request: Any) -> Response:  # pragma: no cover
        return Response({"ok": True})


class PlainView(APIView):
    renderer_classes = [IdempotentBrowsableAPIRenderer]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})

    def post(self, request: Any) -> Response:  # pragma: no cover
        return Response({"ok": True}, status=201)


def page(view: type[APIView]) -> str:
    request = APIRequestFactory().get("/things/", HTTP_ACCEPT="text/html")
    response = view.as_view()(request)
    response.render()
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    return response.content.decode()


def panel(html: str) -> dict[str, str] | None:
    match = re.search(r'<div id="idempotency-key-panel"(.*?)>', html, re.S)
    if match is None:
        return None
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', match[1]))


def test_a_guarded_views_page_has_the_key_field_and_its_script() -> None:
    html = page(GuardedView)
    assert panel(html) == {
        "header": "Idempotency-Key",
        "replay-header": "Idempotent-Replay",
        "methods": "POST",  # PATCH is guarded too, but the view has no PATCH
    }
    assert '<script src="/static/django_idempotency/browsable-api.js"></script>' in html
    # The field is outside every form and has no name, so no form sends it in a body.
    field = re.search(r"<input id=\"idempotency-key\"[^>]*>", html)
    assert field is not None and "name=" not in field[0]
    assert 'id="post-generic-content-form"' in html  # DRF's own page around it


def test_the_methods_and_the_header_follow_the_view_and_the_settings() -> None:
    with override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"}):
        html = page(PutGuardedView)
    assert panel(html) == {
        "header": "X-Request-Key",
        "replay-header": "Idempotent-Replay",
        "methods": "POST PUT",
    }


def test_a_view_that_guards_nothing_gets_drfs_page_as_it_is() -> None:
    html = page(PlainView)
    assert panel(html) is None
    assert "browsable-api.js" not in html
    assert 'id="post-generic-content-form"' in html


class DefaultRenderersView(IdempotencyMixin, APIView):
    """The mixin with DRF's default renderers: its browsable page gets the key field anyway."""

    def get(self, request: Any) -> Response:
        return Response({"ok": True})

    def post(self, request: Any) -> Response:  # pragma: no cover
        return Response({"ok": True}, status=201)


def test_the_mixin_swaps_drfs_browsable_renderer_for_the_one_that_sends_keys():
    html = page(DefaultRenderersView)
    assert "browsable-api.js" in html
    assert panel(html) is not None and panel(html)["methods"] == "POST"
