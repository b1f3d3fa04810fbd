# Two commands matter: `make demo` serves the demo, `make test` runs the whole test suite.
# The test suite runs in four passes (TEST_PASSES below), three at a time (TEST_JOBS), each
# logged to artifacts/<pass>.log (see tests/support/passes.py).
# Service URLs come from the environment (POSTGRES_URL, MARIADB_URL, REDIS_URL, AMQP_URL, NATS_URL);
# see tests/support/backends.py for what happens when one is missing.

SHELL := /bin/bash
PYTHON ?= python3
# Django 6 needs Python 3.12+: the first of these that actually runs is used (pyenv shims
# exist for versions that are not selected, so existence alone proves nothing).
ifndef PYTHON_DJANGO6
PYTHON_DJANGO6 := $(shell for candidate in python3.13 python3.12 \
	$(HOME)/.pyenv/versions/3.13*/bin/python3 $(HOME)/.pyenv/versions/3.12*/bin/python3; do \
	"$$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null \
	&& { "$$candidate" -c 'import sys; print(sys.executable)'; break; }; done)
endif
VENV := .venv
VENV_DJANGO6 := .venv-django6
PIP_FLAGS ?= --quiet --disable-pip-version-check
DJANGO52 := django>=5.2,<5.3
DJANGO6 := django>=6.0,<7
PYTEST := python -m pytest -p no:cacheprovider --durations=15
COVERAGE_FLOOR ?= 90
# The demo: where it listens, and the short leases that let the tour's crash recover quickly
# (a key held by the killed request; outbox events claimed by a relay in the killed process).
DEMO_PORT ?= 8000
DEMO_LEASE_SECONDS ?= 5
DEMO_RELAY_LEASE_SECONDS ?= 10
DEMO_SERVE := $(VENV)/bin/python -m gunicorn --config python:demo_project.gunicorn_conf demo_project.wsgi

# The passes of `make test`, longest first: tests/support/passes.py runs TEST_JOBS of them side by side,
# each with a database of its own and its output in artifacts/<pass>.log, each spread over
# TEST_WORKERS pytest-xdist workers (the tests spend much of their time waiting on sleeps,
# leases and subprocesses). Every test runs on PostgreSQL with Django 5.2 (the reference pass);
# the tests that depend on the database backend run on MariaDB too, and on SQLite with Django 6
# together with those that meet Django itself; the reliability suite runs beside them. The tests
# whose outcome does not depend on the backend are listed in tests/conftest.py (ONCE, and of
# those DJANGO_SERIES).
TEST_PASSES := test-dj52-postgresql test-reliability test-dj6-sqlite test-dj52-mariadb
TEST_JOBS ?= 3
TEST_WORKERS ?= 3
XDIST = -n $(TEST_WORKERS) --dist loadfile
RUN_PASSES = $(VENV)/bin/python -m tests.support.passes --jobs $(TEST_JOBS) --make "$(MAKE)"
# One pass: $(call pytest-pass,VENV,DATABASE,NAME,PYTEST ARGUMENTS); its coverage data goes to
# .coverage.NAME, which `make test` combines with the other passes'.
pytest-pass = rm -f .coverage.$(3) .coverage.$(3).* && TEST_DATABASE=$(2) COVERAGE_FILE=.coverage.$(3) \
	$(1)/bin/$(PYTEST) --cov=django_idempotency --cov-report= $(4)
# What each pass runs (pytest -m).
EVERYTHING := not reliability
BACKEND_ONLY := not reliability and not once
DJANGO_SERIES_TESTS := not reliability and not slow and (not once or django_series)

.PHONY: demo tour test test-quick lint typecheck migrations-check test-django52 test-django6 test-reliability docs clean bench-relay bench-relay-brokers bench-retention bench-admin chaos \
	test-dj52-sqlite test-dj52-postgresql test-dj52-mariadb test-dj6-sqlite test-dj6-postgresql

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

# The demo installs only what it needs (nothing that compiles), so a fresh clone with nothing
# but Python runs it. `make test` later adds the development tools to the same environment.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[demo]"
	touch $@

## demo: install, migrate, create the demo user and accounts, and serve on 127.0.0.1:$(DEMO_PORT)
# SQLite, no Redis, no broker. Served by gunicorn so that a worker killed mid-payment (the
# tour's crash, allowed by DEMO_FAULTS=1) is replaced while the service stays up. Without a
# broker the outbox relay and the ledger consumer run inside the web workers.
demo: $(VENV)/.demo-installed
	$(VENV)/bin/python manage.py demo_setup
	@echo
	@echo "  API      http://127.0.0.1:$(DEMO_PORT)/api/v1/payments/"
	@echo "  Swagger  http://127.0.0.1:$(DEMO_PORT)/api/docs/"
	@echo "  Admin    http://127.0.0.1:$(DEMO_PORT)/admin/  (demo / demo-password)"
	@echo "  Tour     make tour   (in another terminal)"
	@echo
	DEMO_FAULTS=1 IDEMPOTENCY_LEASE_SECONDS=$(DEMO_LEASE_SECONDS) \
		IDEMPOTENCY_RELAY_LEASE_SECONDS=$(DEMO_RELAY_LEASE_SECONDS) \
		GUNICORN_CMD_ARGS="--bind 127.0.0.1:$(DEMO_PORT)" $(DEMO_SERVE)

## tour: play the idempotency story against the running demo
tour: $(VENV)/.demo-installed
	$(VENV)/bin/python manage.py idempotency_tour --url http://127.0.0.1:$(DEMO_PORT)

## test: lint, types, migrations, docs, and the suite on every backend and Django series
test: lint typecheck migrations-check docs $(VENV)/.installed $(VENV_DJANGO6)/.installed
	rm -f .coverage .coverage.*
	$(RUN_PASSES) $(TEST_PASSES)
	$(VENV)/bin/coverage combine --quiet
	$(VENV)/bin/coverage report --fail-under=$(COVERAGE_FLOOR)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy django_idempotency

migrations-check: $(VENV)/.installed
	DJANGO_SETTINGS_MODULE=tests.settings PYTHONPATH=. $(VENV)/bin/django-admin makemigrations --check --dry-run
	DJANGO_SETTINGS_MODULE=tests.support.settings_autofield PYTHONPATH=. $(VENV)/bin/django-admin makemigrations django_idempotency --check --dry-run

## docs: build the documentation into site/, every warning an error
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

## test-quick: the inner loop (about a minute): the tests that depend on the database (the
## request lifecycle, the outbox, the inbox) on SQLite, with no services (those tests skip),
## nothing slow; `make test` runs everything
test-quick: $(VENV)/.installed
	env -u POSTGRES_URL -u MARIADB_URL -u REDIS_URL -u AMQP_URL -u NATS_URL -u REQUIRE_BACKENDS \
		TEST_DATABASE=sqlite $(VENV)/bin/$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile \
		-m "not reliability and not slow and not browser and not concurrency and not once" tests

## test-django52, test-django6: the passes of one Django series
test-django52: $(VENV)/.installed
	$(RUN_PASSES) test-dj52-postgresql test-dj52-mariadb

test-django6: $(VENV_DJANGO6)/.installed
	$(RUN_PASSES) test-dj6-sqlite

## test-dj52-postgresql (every test), test-dj52-mariadb (the backend's own), test-dj6-sqlite
## (the backend's own and those that meet Django): one pass, in the terminal; test-dj52-sqlite and test-dj6-postgresql run the
## backend's own tests, outside `make test`
test-dj52-postgresql: $(VENV)/.installed
	$(call pytest-pass,$(VENV),postgresql,dj52.postgresql,$(XDIST) -m "$(EVERYTHING)")

test-dj52-mariadb test-dj52-sqlite: test-dj52-%: $(VENV)/.installed
	$(call pytest-pass,$(VENV),$*,dj52.$*,$(XDIST) -m "$(BACKEND_ONLY)")

test-dj6-sqlite: $(VENV_DJANGO6)/.installed
	$(call pytest-pass,$(VENV_DJANGO6),sqlite,dj6.sqlite,$(XDIST) -m "$(DJANGO_SERIES_TESTS)")

test-dj6-postgresql: $(VENV_DJANGO6)/.installed
	$(call pytest-pass,$(VENV_DJANGO6),postgresql,dj6.postgresql,$(XDIST) -m "$(BACKEND_ONLY)")

## test-reliability: load, faults, hostile input and the state machine (tests/reliability)
# On PostgreSQL only: the faults restart private PostgreSQL, Redis and RabbitMQ instances that
# the suite starts itself, so the shared services are never touched.
test-reliability: $(VENV)/.installed
	$(call pytest-pass,$(VENV),postgresql,reliability,-n 2 --dist loadfile -m reliability tests/reliability)

## chaos: the demo under load while workers, the database, Redis and the relay are killed; a table
# On PostgreSQL, then on MariaDB, each a private server of the run's own with a private Redis
# (never the shared services); about 4 minutes each. Prints duplicates, lost effects, stuck keys,
# events published once, 409 streaks and commit -> publish delays, one table per database, and
# writes artifacts/chaos.json and artifacts/chaos-mariadb.json. CHAOS_ARGS=--short runs the CI
# version; CHAOS_ARGS="--database mariadb" (or postgresql) one database only.
CHAOS_ARGS ?=
chaos: $(VENV)/.installed
	$(VENV)/bin/python -m tests.reliability.chaos --database all --json artifacts/chaos.json \
		$(CHAOS_ARGS)

## bench-relay: the relay as deployed on PostgreSQL (POSTGRES_URL, REDIS_URL): 1, 2 and 4
## `outbox_relay --loop` processes against the SQL floor, per publisher; writes
## benchmarks/results/relay.json (benchmarks/relay_deployed.py); then a claim's cost with
## 100,000 events behind failed ones (benchmarks/relay_blocked.py)
bench-relay: $(VENV)/.installed
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/relay_deployed.py $(BENCH_ARGS)
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/relay_blocked.py

## bench-relay-brokers: one relay in process per real broker (AMQP_URL, NATS_URL), then relay
## processes with in-memory, AMQP and Celery publishers and commit -> publish latency
bench-relay-brokers: $(VENV)/.installed
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/relay_throughput.py $(BENCH_ARGS)
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/relay_fleet.py

## bench-retention: retention of ROWS expired records on PostgreSQL (POSTGRES_URL), the DELETE
## sweep against dropping a day partition; writes benchmarks/results/retention.json
ROWS ?= 100000
bench-retention: $(VENV)/.installed
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/retention.py --rows $(ROWS) $(BENCH_ARGS)

## bench-admin: the admin's overview page (the last 24 hours) on ADMIN_ROWS records and outbox
## events on PostgreSQL (POSTGRES_URL); benchmarks/admin_overview.py
ADMIN_ROWS ?= 1000000
bench-admin: $(VENV)/.installed
	TEST_DATABASE=postgresql $(VENV)/bin/python benchmarks/admin_overview.py --rows $(ADMIN_ROWS) \
		$(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_DJANGO6) .coverage* site

# --- benchmarks (not part of `make test`; see docs/performance.md) ---------------------------
# The benchmark has its own environment, with the PyPI peers it is compared against; they are
# never dependencies of the project. It needs wrk (apt-get install -y wrk) and PostgreSQL.
BENCH_VENV := benchmarks/.venv
BENCH_ARGS ?=

.PHONY: bench bench-smoke

$(BENCH_VENV)/.installed: pyproject.toml benchmarks/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(BENCH_VENV)/bin/pip install $(PIP_FLAGS) -r benchmarks/requirements.txt
	touch $@

## bench: the HTTP benchmark against the peers, Python calls per request on each path, the in-process microbenchmark, the Bloom filter's case, attached duplicates' latency
bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)
	$(BENCH_VENV)/bin/python -m benchmarks.calls
	$(BENCH_VENV)/bin/python -m benchmarks.micro
	$(BENCH_VENV)/bin/python -m benchmarks.bloom
	$(BENCH_VENV)/bin/python -m benchmarks.attach_latency

## bench-smoke: every benchmark row with a few requests; fails on any error
bench-smoke: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python -m benchmarks.run --smoke --output artifacts/bench-smoke.json
	$(BENCH_VENV)/bin/python -m benchmarks.calls --smoke --output artifacts/calls-smoke.json
	$(BENCH_VENV)/bin/python -m benchmarks.micro --smoke
	$(BENCH_VENV)/bin/python -m benchmarks.bloom --smoke
	$(BENCH_VENV)/bin/python -m benchmarks.attach_latency --smoke
