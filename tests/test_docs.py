"""The reference pages cover what the code has: every setting, check, error code and signal.

(``make docs`` builds the site with warnings as errors; these tests keep its content complete.)
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from django.dispatch import Signal

from django_idempotency import checks, exceptions, signals
from django_idempotency.conf import DEFAULTS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def headings(page: str) -> set[str]:
    """The code spans in a page's ``###`` headings, e.g. ``LEASE_SECONDS``."""
    text = (DOCS / page).read_text()
    return set(re.findall(r"^### `([^`]+)`$", text, flags=re.MULTILINE))


def test_every_setting_has_its_heading_and_nothing_else_does() -> None:
    assert headings("settings.md") == set(DEFAULTS)


def test_every_check_id_is_documented_and_every_documented_id_exists() -> None:
    ids = {
        value
        for name, value in vars(checks).items()
        if re.fullmatch(r"[EW]\d{3}", name) and isinstance(value, str)
    }
    assert ids  # the constants are found at all
    assert headings("checks.md") == ids


def test_every_error_code_and_signal_is_documented() -> None:
    page = (DOCS / "errors-and-signals.md").read_text()
    codes = {
        str(error.default_code)
        for error in vars(exceptions).values()
        if isinstance(error, type)
        and issubclass(error, exceptions.IdempotencyHTTPError)
        and error is not exceptions.IdempotencyHTTPError
    }
    assert codes
    for code in codes:
        assert f"`{code}`" in page, code
    names = [name for name, value in vars(signals).items() if isinstance(value, Signal)]
    assert names
    for name in names:
        assert f"| `{name}` |" in page, name


class MkDocsLoader(yaml.SafeLoader):
    """A safe loader that reads mkdocs.yml's ``!!python/name`` tags as nothing."""


MkDocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *args: None)


def nav_pages(entries: list[object]) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [str(value)]
    return pages


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.load((DOCS.parent / "mkdocs.yml").read_text(), Loader=MkDocsLoader)  # noqa: S506
    listed = set(nav_pages(config["nav"]))
    present = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert listed == present
