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

DOCS = Path(__file__).resolve().parents[2] / "docs"


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


# --- pages that tell the truth -------------------------------------------------------------------

#: ``pip install`` of this package from anywhere but a checkout (or a wheel built from one).
_NOT_FROM_A_CHECKOUT = re.compile(
    r"pip install (?!-e \"/path/to/django-idempotency\[)[^`\n]*django-idempotency"
)


def _pages() -> dict[str, str]:
    pages = {str(path.relative_to(DOCS)): path.read_text() for path in DOCS.rglob("*.md")}
    pages["README.md"] = (DOCS.parent / "README.md").read_text()
    return pages


def test_every_page_installs_the_package_the_same_way() -> None:
    """Not on PyPI yet: every page installs from a checkout, ``pip install -e
    "/path/to/django-idempotency[extras]"``; only installation.md builds a wheel, and the
    future PyPI form appears only where a sentence says it is not published yet."""
    for name, text in _pages().items():
        for paragraph in text.split("\n\n"):
            found = _NOT_FROM_A_CHECKOUT.search(paragraph)
            if found is None or "dist/django_idempotency-" in found[0]:
                continue
            assert "published" in paragraph, f"{name}: {found[0]}"


def test_no_page_describes_the_outbox_or_consumers_as_future_work() -> None:
    for name, text in _pages().items():
        for stale in ("Design level", "design level", "as they land"):
            assert stale not in text, f"{name} says {stale!r}"


def test_the_production_page_is_linked_from_the_home_page() -> None:
    assert "(production.md)" in (DOCS / "index.md").read_text()


def _exported_metric_names() -> set[str]:
    from prometheus_client import REGISTRY

    from django_idempotency.operations.gauges import OutboxCollector

    names: set[str] = set()
    for family in [*REGISTRY.collect(), *OutboxCollector().describe()]:
        if not family.name.startswith("django_idempotency_"):
            continue
        names.add(family.name)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        if family.type == "histogram":
            names.update(f"{family.name}_{part}" for part in ("bucket", "count", "sum"))
    return names


def test_the_production_page_names_only_metrics_the_app_exports() -> None:
    page = (DOCS / "production.md").read_text()
    named = set(re.findall(r"django_idempotency_[a-z_]+", page))
    assert named  # the page has its alerts
    assert named <= _exported_metric_names(), named - _exported_metric_names()


def test_the_production_alert_rules_are_valid_yaml() -> None:
    page = (DOCS / "production.md").read_text()
    (block,) = re.findall(r'```yaml title="django-idempotency.rules.yml"\n(.*?)\n```', page, re.S)
    rules = yaml.safe_load(block)["groups"][0]["rules"]
    assert all({"alert", "expr"} <= set(rule) for rule in rules)


def test_the_beat_override_example_changes_interval_and_expiry_together() -> None:
    from django_idempotency.tasks import BEAT_SCHEDULE

    page = (DOCS / "tasks.md").read_text()
    (block,) = re.findall(r"```python\n(CELERY_BEAT_SCHEDULE = \{\n.*?)\n```", page, re.S)
    namespace: dict[str, object] = {"BEAT_SCHEDULE": BEAT_SCHEDULE}
    exec(block, namespace)  # noqa: S102 - the page's own example
    schedule = namespace["CELERY_BEAT_SCHEDULE"]
    assert isinstance(schedule, dict)
    changed = [name for name, entry in schedule.items() if entry != BEAT_SCHEDULE.get(name)]
    assert changed
    for name in changed:
        entry = schedule[name]
        assert entry["options"]["expires"] < entry["schedule"], name
    for name, entry in BEAT_SCHEDULE.items():
        assert entry["options"]["expires"] < entry["schedule"], name


def test_every_name_the_api_reference_documents_imports() -> None:
    """``docs/api.md`` is the public API: every ``::: path`` on it is importable as written."""
    import importlib

    paths = re.findall(r"^::: ([\w.]+)$", (DOCS / "api.md").read_text(), flags=re.MULTILINE)
    assert len(paths) > 20
    missing = []
    for path in paths:
        module, _, name = path.rpartition(".")
        try:
            imported = importlib.import_module(path)
        except ImportError:
            imported = getattr(importlib.import_module(module), name, None)
        if imported is None:
            missing.append(path)
    assert not missing


def test_every_guarantee_names_the_test_that_proves_it() -> None:
    """Each row of the guarantees' tables (those whose last column is "test") names the test
    behind it, and every test a guarantees page names by its path from the checkout
    (``tests/<package>/test_<name>.py::test_<name>``) is there."""
    rows: list[tuple[str, str, str]] = []
    named: list[tuple[str, str]] = []
    for page in sorted(DOCS.glob("guarantees*.md")):
        named += [
            (page.name, match)
            for match in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", page.read_text())
        ]
        header: list[str] | None = None
        for line in page.read_text().splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-: ") and header[-1].lower() == "test":
                rows.append((page.name, cells[0][:60], cells[-1]))
    assert len(rows) > 50
    unproven = [row for row in rows if "test" not in row[2]]
    assert not unproven
    assert len(named) > 50
    missing = []
    for page, reference in named:
        path, _, function = reference.partition("::")
        source = DOCS.parent / path
        if not source.is_file() or (function and f"def {function}(" not in source.read_text()):
            missing.append((page, reference))
    assert not missing


def test_the_changelog_and_every_page_stay_a_size_a_user_reads() -> None:
    """The changelog and the performance page at most 12 KB, any other page at most 30 KB: the
    laboratory notebook is ``benchmarks/NOTES.md``, the history is git's."""
    root = DOCS.parent
    assert len((root / "CHANGELOG.md").read_bytes()) <= 12 * 1024
    assert len((DOCS / "performance.md").read_bytes()) <= 12 * 1024
    too_big = [page.name for page in DOCS.rglob("*.md") if len(page.read_bytes()) > 30 * 1024]
    assert not too_big
