"""The demo payments service. Importing it loads its Celery app, as Celery's Django guide does."""

from demo_project.celery import app as celery_app

__all__ = ["celery_app"]
