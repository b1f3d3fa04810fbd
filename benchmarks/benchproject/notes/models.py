from django.db import models


class Note(models.Model):
    """Three fields and no relations: one INSERT is all the endpoint's own work."""

    title = models.CharField(max_length=100)
    body = models.CharField(max_length=200)
    done = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.title


class FloorClaim(models.Model):
    """A key claimed by the first-time floor view (``views.FloorNoteView``): the least a claim
    committed before the view and completed inside its transaction writes, the key under its
    scope (unique together), the request's fingerprint, its owner and the end of its lease (a
    claim whose request died must be taken over, and the completion must be its owner's), when
    the record expires (indexed: a sweep must find what to delete) and, at completion, the
    answer a retry gets, with no idempotency library's code around it."""

    scope = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    fingerprint = models.BinaryField()
    owner = models.UUIDField()
    lease_expires_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    status = models.PositiveSmallIntegerField(null=True)
    body = models.BinaryField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="bench_floorclaim_scope_key")
        ]

    def __str__(self) -> str:
        return self.key


class FloorRecord(models.Model):
    """A stored answer the database replay floor reads (``views.floor_database``): the least a
    record needs (its scope and key, unique together, its expiry, the fingerprint of the request
    that made it, the answer's status and body),
    seeded by ``benchmarks.run`` for exactly the keys the floor rows send."""

    scope = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    expires_at = models.DateTimeField()
    fingerprint = models.BinaryField()
    status = models.PositiveSmallIntegerField()
    body = models.BinaryField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="bench_floorrecord_scope_key")
        ]

    def __str__(self) -> str:
        return self.key
