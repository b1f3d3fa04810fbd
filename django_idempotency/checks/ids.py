"""The checks' ids, stable: one constant per id, never renumbered nor reused once retired.

``docs/checks.md`` documents each one with its fix; the rows that use them live in the modules
of their groups.
"""

# Layer 1: request settings, middleware and databases
E001 = "django_idempotency.E001"  # IDEMPOTENCY is not a dict
E002 = "django_idempotency.E002"  # LEASE_SECONDS not a positive number
E003 = "django_idempotency.E003"  # TTL_SECONDS not a positive number
E004 = "django_idempotency.E004"  # TTL_SECONDS shorter than LEASE_SECONDS
E005 = "django_idempotency.E005"  # SCOPE_RESOLVER does not import or is not callable
E006 = "django_idempotency.E006"  # STORED_STATUS_CODES not HTTP status codes
E007 = "django_idempotency.E007"  # STORED_RESPONSE_HEADERS not header names
E008 = "django_idempotency.E008"  # MAX_RESPONSE_BYTES not a non-negative integer
E009 = "django_idempotency.E009"  # a header-name setting is not a valid header name
E010 = "django_idempotency.E010"  # MIDDLEWARE_PATHS not valid regular expressions
E011 = "django_idempotency.E011"  # KEY_REQUIRED, LEASE_HEARTBEAT or LOG_KEYS is not a boolean
E012 = "django_idempotency.E012"  # MIDDLEWARE_METHODS not HTTP methods
E013 = "django_idempotency.E013"  # a middleware after IdempotencyMiddleware has process_view
E014 = "django_idempotency.E014"  # CREDENTIAL_SCOPE is neither "digest" nor "refuse"
E015 = "django_idempotency.E015"  # CREDENTIAL_HEADERS is not a list of header names
E016 = "django_idempotency.E016"  # an ATTACH_*_WAIT_SECONDS setting is not a number >= 0
E017 = "django_idempotency.E017"  # ATTACH_MAX_WAITERS(_PER_SCOPE) is not an integer >= 0
E018 = "django_idempotency.E018"  # ATTACH_POLL_SECONDS is not a positive number
E019 = "django_idempotency.E019"  # HANDOFF_HOLD_SECONDS is not a positive number
W001 = "django_idempotency.W001"  # unknown key in IDEMPOTENCY
W002 = "django_idempotency.W002"  # STORED_RESPONSE_HEADERS lists a header never stored
W003 = "django_idempotency.W003"  # SQLite without IMMEDIATE transactions
W004 = "django_idempotency.W004"  # middleware placed before AuthenticationMiddleware
W005 = "django_idempotency.W005"  # IdempotencyRecord routed to a database other than "default"
W006 = "django_idempotency.W006"  # USE_TZ = False
W007 = "django_idempotency.W007"  # middleware paths behind DRF token/JWT/Basic authentication
W008 = "django_idempotency.W008"  # deploy: guarded views share the anonymous scope
W009 = "django_idempotency.W009"  # deploy: session features behind a transaction-mode pooler
W010 = "django_idempotency.W010"  # deploy: TTL_SECONDS shorter than clients retry (a day)
W011 = "django_idempotency.W011"  # one scope's waiting duplicates could hold every server thread
# Layers 2 and 3: outbox, consumers, sweeps
E020 = "django_idempotency.E020"  # OUTBOX_PUBLISHERS not a dict of pattern -> publisher spec
E021 = "django_idempotency.E021"  # a publisher backend does not import or is not a Publisher
E022 = "django_idempotency.E022"  # a count setting is not a positive integer
E023 = "django_idempotency.E023"  # a duration setting is not a positive number
E024 = "django_idempotency.E024"  # OUTBOX_BACKOFF_MAX_SECONDS below OUTBOX_BACKOFF_BASE_SECONDS
E025 = "django_idempotency.E025"  # OUTBOX_KICK does not import or is not callable
E026 = "django_idempotency.E026"  # OUTBOX_REQUIRE_ATOMIC or OUTBOX_NOTIFY is not a boolean
E027 = "django_idempotency.E027"  # OUTBOX_KICK set while OUTBOX_PUBLISHERS is empty
E028 = "django_idempotency.E028"  # a route's OPTIONS do not fit its publisher's arguments
W020 = "django_idempotency.W020"  # INBOX_RETENTION shorter than the redelivery horizon
W021 = "django_idempotency.W021"  # an idempotent consumer task without acks_late
W022 = "django_idempotency.W022"  # database without SELECT ... FOR UPDATE SKIP LOCKED
W023 = "django_idempotency.W023"  # an idempotent consumer task without reject_on_worker_lost
W024 = "django_idempotency.W024"  # OUTBOX_PUBLISHERS has no catch-all ("*") route
W025 = "django_idempotency.W025"  # the default OUTBOX_KICK without Celery relays in-process
W026 = "django_idempotency.W026"  # a NATS duplicate window shorter than the retry horizon
W027 = "django_idempotency.W027"  # deploy: the outbox's Celery broker is Redis without timeouts
# Caches: the Redis copy, and answers kept in memory
E040 = "django_idempotency.E040"  # CACHE_ALIAS is not None or a configured cache alias
E041 = "django_idempotency.E041"  # CACHE_ALIAS names a cache that is not django-redis
E042 = "django_idempotency.E042"  # CACHE_RETRY_SECONDS is not a number >= 0
E043 = "django_idempotency.E043"  # LOCAL_REPLAY_SECONDS is not a number >= 0
E044 = "django_idempotency.E044"  # LOCAL_REPLAY_ENTRIES is not a positive integer
W040 = "django_idempotency.W040"  # the CACHE_ALIAS cache has no socket timeouts
W041 = "django_idempotency.W041"  # deploy: LOCAL_REPLAY_SECONDS on, and several processes run
# Operations
E060 = "django_idempotency.E060"  # REGISTER_ADMIN, METRICS or TRACING is not a boolean
W060 = "django_idempotency.W060"  # METRICS set to True but prometheus_client is not installed
W061 = "django_idempotency.W061"  # TRACING set to True but opentelemetry-api is not installed
W062 = "django_idempotency.W062"  # deploy: the sweeps are not scheduled (or have not run)
# Storage at scale: the partitioned records, outbox and inbox tables (E082-W081: any of them)
E080 = "django_idempotency.E080"  # RECORD_/OUTBOX_/INBOX_PARTITIONS is not a boolean
E081 = "django_idempotency.E081"  # PARTITION_SPAN_DAYS or PARTITION_AHEAD_DAYS not a positive int
E082 = "django_idempotency.E082"  # RECORD_PARTITIONS on, the records database is not PostgreSQL
E083 = "django_idempotency.E083"  # the records table is partitioned, RECORD_PARTITIONS is off
E084 = "django_idempotency.E084"  # the app's tables are missing or its migrations unapplied
W080 = "django_idempotency.W080"  # RECORD_PARTITIONS on, the records table is still plain
W081 = "django_idempotency.W081"  # the next partition of the records table does not exist yet
