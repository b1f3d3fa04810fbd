"""Headless Chromium for the end-to-end tests (the admin, the browsable API, Swagger UI).

Uses Debian's ``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them); nothing
is downloaded. Every host but 127.0.0.1 is made unresolvable, so a page that needs the internet
fails here as it would offline. Screenshots go to ``artifacts/browser/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.backends import backends_required

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
#: The width the admin pages are checked at: a common laptop screen.
LAPTOP_WIDTH = 1280
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    # Offline but for this machine: any other host fails to resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
)


def chromium(tmp_path: Path, width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A Chromium driver for a fixture to yield; skips (or fails under REQUIRE_BACKENDS) when
    Chromium is not installed. The performance log records every request the pages make."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = "apt-get install chromium chromium-driver"
        if backends_required():
            pytest.fail(f"Chromium is required: {message}")
        pytest.skip(f"Chromium is not installed: {message}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def save_screenshot(driver: Any, name: str) -> None:
    """The page as ``artifacts/browser/<name>.png``, written whole: passes of ``make test`` that
    run side by side save the same names, and a reader must find one of them, never a mix."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    target = ARTIFACTS / f"{name}.png"
    with tempfile.NamedTemporaryFile(dir=ARTIFACTS, prefix=f".{name}-", delete=False) as part:
        part.write(driver.get_screenshot_as_png())
    os.replace(part.name, target)


def wait_for(driver: Any, css: str, timeout: float = 30) -> Any:
    """The first element ``css`` finds, once there is one."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def requested_urls(driver: Any) -> list[str]:
    """Every http(s) URL the browser asked for since the last call (from the performance log);
    the browser's own ``chrome:`` and ``data:`` URLs are left out."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                urls.append(url)
    return urls


def set_width(driver: Any, width: int) -> None:
    """Make the page's viewport (not the window, which has a frame) ``width`` CSS pixels wide."""
    driver.set_window_size(width, driver.get_window_size()["height"])
    inner = driver.execute_script("return window.innerWidth")
    if inner != width:
        size = driver.get_window_size()
        driver.set_window_size(size["width"] + width - inner, size["height"])


def clipped(driver: Any) -> list[str]:
    """What on the page ends beyond the right edge of the space it is shown in: header cells of
    a changelist (or any results table) past their scrolling results box or the viewport, and
    change-page rows and fieldsets past the viewport. An empty list when nothing needs scrolling
    sideways."""
    return driver.execute_script(
        """
        const viewport = document.documentElement.clientWidth;
        const cut = [];
        const label = (el) => (el.textContent.trim().split("\\n")[0] || el.className).trim();
        for (const th of document.querySelectorAll("#result_list thead th, "
                                                   + "#content .results thead th")) {
            const box = th.closest(".results") || document.documentElement;
            const right = Math.min(viewport, box.getBoundingClientRect().right);
            if (th.getBoundingClientRect().right > right + 0.5) cut.push(label(th));
        }
        for (const el of document.querySelectorAll("#content fieldset, #content .form-row, "
                                                   + "#content .submit-row")) {
            if (el.getBoundingClientRect().right > viewport + 0.5) cut.push(label(el));
        }
        if (document.documentElement.scrollWidth > viewport + 0.5) cut.push("(the page)");
        return cut;
        """
    )
