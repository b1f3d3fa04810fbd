"""Test settings for a server on its own SQLite file, with startproject's defaults or IMMEDIATE.

``SQLITE_FILE`` names the file; ``SQLITE_TRANSACTION_MODE=IMMEDIATE`` adds the options the docs
recommend, anything else leaves Django's defaults (DEFERRED transactions, a 5 s timeout).
"""

import os

from tests.settings import *  # noqa: F403

ROOT_URLCONF = "tests.support.sqlite_locking_urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["SQLITE_FILE"],
        "OPTIONS": (
            {"transaction_mode": "IMMEDIATE", "timeout": 20}
            if os.environ.get("SQLITE_TRANSACTION_MODE") == "IMMEDIATE"
            else {}
        ),
    }
}
# The view's warning, naming the database error behind a 503, goes to the server's stderr.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"tests.support.sqlite_locking_urls": {"handlers": ["stderr"], "level": "WARNING"}},
}
