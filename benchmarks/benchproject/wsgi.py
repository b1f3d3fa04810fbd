import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.benchproject.settings")
application = get_wsgi_application()

from benchmarks.benchproject import counting  # noqa: E402  (needs the settings configured)

counting.install()
