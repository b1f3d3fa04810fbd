"""Swagger UI at ``/api/docs/`` works offline: every file it loads is served by the demo itself
(drf-spectacular-sidecar), none comes from a CDN."""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import drf_spectacular_sidecar
import pytest

from tests.demo.conftest import DemoServer
from tests.support.browser_support import chromium, requested_urls, save_screenshot, wait_for

SIDECAR_STATIC = Path(drf_spectacular_sidecar.__file__).parent / "static"


def fetch(server: DemoServer, path: str) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection(urlsplit(server.url).netloc, timeout=60)
    try:
        connection.request("GET", path, headers={"Accept": "text/html"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def test_the_docs_page_refers_only_to_files_the_demo_serves(demo_server: DemoServer) -> None:
    status, _, body = fetch(demo_server, "/api/docs/")
    assert status == 200
    page = body.decode()
    # No absolute or scheme-relative URL anywhere in the page, inline script included.
    assert re.findall(r"(?:https?:)?//[\w.-]+\.\w+", page) == []
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert {asset.rsplit("/", 1)[-1] for asset in assets} >= {
        "swagger-ui.css",
        "swagger-ui-bundle.js",
        "swagger-ui-standalone-preset.js",
        "favicon-32x32.png",
    }
    for asset in assets:
        assert asset.startswith("/static/drf_spectacular_sidecar/swagger-ui-dist/"), asset
        status, content_type, content = fetch(demo_server, asset)
        assert status == 200, asset
        assert content_type.split(";")[0] in ("text/css", "text/javascript", "image/png"), asset
        assert content == (SIDECAR_STATIC / asset.removeprefix("/static/")).read_bytes(), asset


@pytest.fixture
def browser(tmp_path: Any) -> Iterator[Any]:
    yield from chromium(tmp_path)


@pytest.mark.browser
def test_swagger_ui_shows_the_api_without_internet(demo_server: DemoServer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{demo_server.url}/api/docs/")
    wait_for(browser, ".opblock-summary-path")
    operations = browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
    assert "/api/v1/payments/" in {operation.text.strip() for operation in operations}
    save_screenshot(browser, "swagger-ui")
    urls = requested_urls(browser)
    assert urls
    assert [url for url in urls if not url.startswith(f"{demo_server.url}/")] == []
