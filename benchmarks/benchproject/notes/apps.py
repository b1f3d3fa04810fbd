from django.apps import AppConfig


class NotesConfig(AppConfig):
    name = "benchmarks.benchproject.notes"
    label = "bench_notes"
    default_auto_field = "django.db.models.BigAutoField"
