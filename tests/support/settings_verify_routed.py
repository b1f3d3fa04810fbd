"""The test settings with every model of django_idempotency routed to the ``records`` database and
ATOMIC_REQUESTS on: the project ``idempotency_verify`` runs against in its subprocess test."""

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASE_ROUTERS = ["tests.support.routers.RecordsElsewhere"]
for _alias in DATABASES:
    DATABASES[_alias]["ATOMIC_REQUESTS"] = True
