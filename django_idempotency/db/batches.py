"""Work through a selection in locked batches, one short transaction per batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from django.db import router, transaction
from django.db.models import Model, QuerySet

__all__ = ["Row", "locked_batches"]

T = TypeVar("T")
Row = tuple[Any, ...]


def locked_batches(
    queryset: QuerySet[Any],
    fields: Sequence[str],
    batch_size: int,
    change: Callable[[str, list[Row]], T],
) -> Iterator[T]:
    """Call ``change(using, rows)`` per batch of ``(pk, *fields)`` rows, locked, in pk order.

    Each batch is its own transaction, committed before its result is yielded, so whatever the
    caller does with a result (send signals, say) happens after the commit.
    """
    model: type[Model] = queryset.model
    using = router.db_for_write(model)
    candidates = queryset.using(using).order_by("pk")
    last_pk: Any = None
    while True:
        with transaction.atomic(using=using):
            batch = candidates if last_pk is None else candidates.filter(pk__gt=last_pk)
            rows = list(batch.select_for_update().values_list("pk", *fields)[:batch_size])
            if not rows:
                return
            result = change(using, rows)
        last_pk = rows[-1][0]
        yield result
