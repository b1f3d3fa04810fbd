# Two commands matter: `make demo` serves the demo, `make test` runs the whole test suite.
# The test suite runs once per database backend and once per supported Django series.
# Service URLs come from the environment (POSTGRES_URL, MARIADB_URL, REDIS_URL, AMQP_URL);
# see tests/backends.py for what happens when one is missing.

SHELL := /bin/bash
PYTHON ?= python3
# Django 6 needs Python 3.12+; the first of these that exists is used.
PYTHON_DJANGO6 ?= $(firstword $(shell command -v python3.13 python3.12 2>/dev/null) \
	$(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3 $(HOME)/.pyenv/versions/3.12*/bin/python3))
VENV := .venv
VENV_DJANGO6 := .venv-django6
PIP_FLAGS ?= --quiet --disable-pip-version-check
DJANGO52 := django>=5.2,<5.3
DJANGO6 := django>=6.0,<7
PYTEST := python -m pytest -p no:cacheprovider
COVERAGE_FLOOR ?= 90

.PHONY: demo test lint typecheck migrations-check test-django52 test-django6 docs clean bench-relay

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -r requirements-dev.txt "$(DJANGO52)"
	touch $@

$(VENV_DJANGO6)/.installed: pyproject.toml requirements-dev.txt
	@test -n "$(PYTHON_DJANGO6)" || { echo "Django 6 needs Python 3.12+; set PYTHON_DJANGO6"; exit 1; }
	$(PYTHON_DJANGO6) -m venv $(VENV_DJANGO6)
	$(VENV_DJANGO6)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV_DJANGO6)/bin/pip install $(PIP_FLAGS) -r requirements-dev.txt "$(DJANGO6)"
	touch $@

## demo: install, migrate, create the demo user and accounts, and serve on :8000
demo: $(VENV)/.installed
	$(VENV)/bin/python manage.py migrate --noinput
	$(VENV)/bin/python manage.py demo_setup
	$(VENV)/bin/python manage.py runserver 127.0.0.1:8000

## test: lint, types, migrations, and the suite on every backend and Django series
test: lint typecheck migrations-check test-django52 test-django6
	$(VENV)/bin/coverage combine --quiet
	$(VENV)/bin/coverage report --fail-under=$(COVERAGE_FLOOR)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy django_idempotency

migrations-check: $(VENV)/.installed
	DJANGO_SETTINGS_MODULE=tests.settings PYTHONPATH=. $(VENV)/bin/django-admin makemigrations --check --dry-run
	DJANGO_SETTINGS_MODULE=tests.settings_autofield PYTHONPATH=. $(VENV)/bin/django-admin makemigrations django_idempotency --check --dry-run

test-django52: $(VENV)/.installed
	rm -f .coverage .coverage.*
	for db in sqlite postgresql mariadb; do \
		echo "== Django 5.2 / $$db"; \
		TEST_DATABASE=$$db COVERAGE_FILE=.coverage.dj52.$$db $(VENV)/bin/$(PYTEST) \
			--cov=django_idempotency --cov-report= -m "not reliability" || exit 1; \
	done

test-django6: $(VENV_DJANGO6)/.installed
	for db in sqlite postgresql; do \
		echo "== Django 6 / $$db"; \
		TEST_DATABASE=$$db COVERAGE_FILE=.coverage.dj6.$$db $(VENV_DJANGO6)/bin/$(PYTEST) \
			--cov=django_idempotency --cov-report= -m "not reliability" || exit 1; \
	done

## bench-relay: outbox relay events/s on PostgreSQL (POSTGRES_URL; AMQP_URL for the AMQP rows)
bench-relay: $(VENV)/.installed
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/relay_throughput.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_DJANGO6) .coverage* site
