from django.db import models


class Note(models.Model):
    """Three fields and no relations: one INSERT is all the endpoint's own work."""

    title = models.CharField(max_length=100)
    body = models.CharField(max_length=200)
    done = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.title
