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
    committed before the view and completed inside its transaction writes, the key (unique)
    and, at completion, the answer a retry gets, with no idempotency library's code around it."""

    key = models.CharField(max_length=255, unique=True)
    status = models.PositiveSmallIntegerField(null=True)
    body = models.BinaryField(null=True)

    def __str__(self) -> str:
        return self.key
