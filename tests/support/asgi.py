"""ASGI entry point for the server processes some tests start (uvicorn tests.support.asgi)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
application = get_asgi_application()
