from django.db import models


class Widget(models.Model):
    """The business row each test request creates: counting them counts effects."""

    name = models.CharField(max_length=200)
    created_by = models.CharField(max_length=200, blank=True)

    def __str__(self) -> str:
        return self.name
