"""What a relay reports: the counts of its passes, and the routes whose events failed.

``outbox_relay`` prints both, the Celery task returns the counts, and an operator reads the
failures to learn which broker is down and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from django_idempotency.core.failures import describe
from django_idempotency.exceptions import IdempotencyConfigurationError
from django_idempotency.publishers.routing import resolve_route

if TYPE_CHECKING:
    from django_idempotency.models import OutboxEvent

__all__ = ["RelayStats", "RouteFailure", "RouteFailures"]


@dataclass(slots=True)
class RelayStats:
    """What a pass (or several) did. ``released``: claimed but not sent (the lease was running
    short, or an earlier event with the same key failed). ``lost``: published, but the lease
    was taken over meanwhile, so another relay sends them again. ``recorded_late``: outcomes
    kept through a database outage and recorded once it was back. ``reclaimed``: events
    released from the batches of relays that are gone."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    lost: int = 0
    recorded_late: int = 0
    reclaimed: int = 0

    def add(self, other: RelayStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class RouteFailure:
    """Events of one route (``OUTBOX_PUBLISHERS`` pattern) that failed, and the last cause: what
    an operator needs to know which broker is down and why."""

    route: str
    publisher: str
    cause: str
    failed: int = 0
    dead: int = 0

    def __str__(self) -> str:
        count = self.failed + self.dead
        events = f"{count} event{'s' if count != 1 else ''}"
        dead = f" ({self.dead} now DEAD)" if self.dead else ""
        via = f" ({self.publisher})" if self.publisher else ""
        return f"{self.route}{via}: {events}{dead}, {self.cause}"


class RouteFailures:
    """The routes whose events failed since a relay was made, each with its last cause."""

    def __init__(self) -> None:
        self._by_route: dict[str, RouteFailure] = {}

    def count(
        self, event: OutboxEvent, error: BaseException, *, dead: bool, publisher: str
    ) -> None:
        """Count ``event``'s failure on its route; ``publisher`` is the class it went to."""
        try:
            route = f"route {resolve_route(event.topic).pattern!r}"
        except IdempotencyConfigurationError:  # no pattern matches its topic, or a bad route
            route = f"topic {event.topic!r} (no route)"
        failure = self._by_route.setdefault(route, RouteFailure(route, publisher, ""))
        failure.publisher = publisher or failure.publisher
        failure.cause = describe(error)
        if dead:
            failure.dead += 1
        else:
            failure.failed += 1

    def as_list(self) -> list[RouteFailure]:
        return list(self._by_route.values())
