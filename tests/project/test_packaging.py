"""The install commands of README and docs/installation.md work: the wheel and the sdist build
from a checkout, carry what the app needs at run time (templates, static files, migrations,
``py.typed``, the license) and, for the sdist, the docs sources and the changelog; each of them
installs into a fresh virtual environment, where a minimal project runs its migrations,
``manage.py check`` and ``manage.py idempotency_verify``, away from the checkout."""

from __future__ import annotations

import shutil
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.slow import NOT_SOURCES, ROOT, fresh_venv, once_per_run, run, venv_environment

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


def test_the_wheel_carries_the_modules_the_runtime_data_and_the_license(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    modules = {name for name in files_under(PACKAGE) if name.endswith(".py")}
    assert modules - names == set()
    assert {name for name in modules if "/migrations/" in name} - names == set()
    assert "django_idempotency/migrations/0001_initial.py" in names
    assert RUNTIME_DATA - names == set()
    assert "django_idempotency/static/django_idempotency/browsable-api.js" in names
    assert any(".dist-info/" in name and name.endswith("/LICENSE") for name in names), names
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
    assert "django_idempotency/migrations/0001_initial.py" in names
    assert "docs/index.md" in names and "django_idempotency/py.typed" in names
    assert "LICENSE" in names
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert not any(name.startswith(("tests/", "demo_project/", "benchmarks/")) for name in names)


SETTINGS = """
SECRET_KEY = "packaging-test"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.sessions", "django.contrib.messages", "django.contrib.staticfiles",
    "rest_framework", "django_idempotency",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {"default": {
    "ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3",
    "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
}}
ROOT_URLCONF = "minimal.urls"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
IDEMPOTENCY = {
    "OUTBOX_PUBLISHERS": {"*": "django_idempotency.publishers.log.LoggingPublisher"},
    "OUTBOX_KICK": None,
}
"""

URLS = """
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""

MANAGE = """
import os, sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "minimal.settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""

PROBE = """
import pathlib
import django
django.setup()
import django_idempotency, django_idempotency.drf
from django.template.loader import get_template
package = pathlib.Path(django_idempotency.__file__).parent
print(package)
print((package / "py.typed").exists())
print(get_template("admin/django_idempotency/change_list.html").origin.name)
"""


def minimal_project(where: Path) -> Path:
    """A project as ``startproject`` would make it, with the app installed."""
    (where / "minimal").mkdir(parents=True)
    (where / "minimal" / "__init__.py").write_text("")
    (where / "minimal" / "settings.py").write_text(SETTINGS)
    (where / "minimal" / "urls.py").write_text(URLS)
    (where / "manage.py").write_text(MANAGE)
    return where


@pytest.mark.parametrize("artifact", ["wheel", "sdist"])
def test_each_artifact_installs_into_a_fresh_venv_and_a_project_runs_on_it(
    built: Built, tmp_path: Path, artifact: str
) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    env = venv_environment(bin_dir)
    path = built.wheel if artifact == "wheel" else built.sdist
    run([str(bin_dir / "pip"), "install", "--quiet", f"{path}[drf]"], cwd=tmp_path, env=env)
    project = minimal_project(tmp_path / "project")
    env = {**env, "DJANGO_SETTINGS_MODULE": "minimal.settings", "PYTHONPATH": str(project)}
    python = str(bin_dir / "python")

    package, typed, template = run([python, "-c", PROBE], cwd=project, env=env).splitlines()[:3]
    assert package.startswith(str(tmp_path / "venv"))  # the installed copy, not the checkout
    assert typed == "True"
    assert template.startswith(package)

    run([python, "manage.py", "migrate", "--verbosity", "0"], cwd=project, env=env)
    shown = run([python, "manage.py", "showmigrations", "django_idempotency"], cwd=project, env=env)
    assert "[X] 0001_initial" in shown and "[ ]" not in shown
    run([python, "manage.py", "check", "--fail-level", "WARNING"], cwd=project, env=env)
    run([python, "manage.py", "makemigrations", "--check", "--dry-run"], cwd=project, env=env)
    verified = run([python, "manage.py", "idempotency_verify"], cwd=project, env=env)
    assert "Every check passed." in verified
