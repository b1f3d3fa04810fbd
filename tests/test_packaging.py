"""The install commands of README and docs/installation.md work: the wheel and the sdist build
from a checkout, carry what the app needs at run time (templates, static files, migrations,
``py.typed``) and, for the sdist, the docs and the changelog; the wheel installs into a fresh
virtual environment and runs there, away from the checkout."""

from __future__ import annotations

import shutil
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slow import NOT_SOURCES, ROOT, fresh_venv, once_per_run, run, venv_environment

pytestmark = once_per_run

PACKAGE = ROOT / "django_idempotency"


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


def files_under(directory: Path) -> set[str]:
    """Paths (relative to the checkout) of the files under ``directory``, caches left out."""
    return {
        str(path.relative_to(ROOT))
        for path in directory.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


#: Data files the app reads at run time: what the wheel must carry besides its modules.
RUNTIME_DATA = {
    *files_under(PACKAGE / "templates"),
    *files_under(PACKAGE / "static"),
    "django_idempotency/py.typed",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build`` on a copy of the checkout, so the build never writes into it."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES, "*.sqlite3*"))
    run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(source)], cwd=work)
    (wheel,) = (work / "dist").glob("django_idempotency-*.whl")
    (sdist,) = (work / "dist").glob("django_idempotency-*.tar.gz")
    return Built(wheel, sdist)


def test_the_wheel_carries_the_modules_and_the_runtime_data(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    modules = {name for name in files_under(PACKAGE) if name.endswith(".py")}
    assert modules - names == set()  # migrations included
    assert RUNTIME_DATA - names == set()
    assert "django_idempotency/static/django_idempotency/browsable-api.js" in names
    assert not any(name.startswith(("tests/", "demo_project/", "benchmarks/")) for name in names)


def test_the_sdist_carries_the_package_docs_and_changelog(built: Built) -> None:
    with tarfile.open(built.sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        names = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    expected = {
        "README.md",
        "CHANGELOG.md",
        "pyproject.toml",
        "mkdocs.yml",
        *files_under(ROOT / "docs"),
        *files_under(PACKAGE),
    }
    assert expected - names == set()
    licenses = {path.name for path in ROOT.glob("LICEN[CS]E*")}
    assert licenses <= names
    assert not any(name.startswith(("tests/", "demo_project/", "benchmarks/")) for name in names)


def test_the_wheel_installs_into_a_fresh_venv_and_runs_from_there(
    built: Built, tmp_path: Path
) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    env = venv_environment(bin_dir)
    run([str(bin_dir / "pip"), "install", "--quiet", f"{built.wheel}[drf]"], cwd=tmp_path, env=env)
    script = """
import django, pathlib, sys
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                    "django.contrib.sessions", "django.contrib.messages",
                    "django.contrib.staticfiles", "rest_framework", "django_idempotency"],
    MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                "django.contrib.auth.middleware.AuthenticationMiddleware",
                "django.contrib.messages.middleware.MessageMiddleware"],
    TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
                "OPTIONS": {"context_processors": [
                    "django.template.context_processors.request",
                    "django.contrib.auth.context_processors.auth",
                    "django.contrib.messages.context_processors.messages"]}}],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:",
                           "OPTIONS": {"transaction_mode": "IMMEDIATE"}}},
    IDEMPOTENCY={"OUTBOX_PUBLISHERS": {"*": "django_idempotency.publishers.log.LoggingPublisher"},
                 "OUTBOX_KICK": None},
    STATIC_URL="static/",
)
django.setup()
import django_idempotency, django_idempotency.drf
from django.core.management import call_command
from django.template.loader import get_template
package = pathlib.Path(django_idempotency.__file__).parent
print(package)
print((package / "py.typed").exists())
print(get_template("admin/django_idempotency/change_list.html").origin.name)
call_command("migrate", "django_idempotency", verbosity=0)
call_command("check", fail_level="WARNING")
"""
    output = run([str(bin_dir / "python"), "-c", script], cwd=tmp_path, env=env).splitlines()
    package, typed, template = output[:3]
    assert package.startswith(str(tmp_path / "venv"))
    assert typed == "True"
    assert template.startswith(package)
