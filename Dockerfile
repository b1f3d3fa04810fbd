# The demo service's image, used by docker-compose.yml for web, the Celery worker and beat.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app
COPY pyproject.toml README.md ./
COPY django_idempotency ./django_idempotency
RUN pip install --no-cache-dir ".[demo]" "psycopg[binary]>=3.1"
COPY manage.py ./
COPY demo_project ./demo_project

RUN useradd --create-home --uid 1000 demo
USER demo
EXPOSE 8000
