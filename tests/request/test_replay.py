import pytest

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Widget

pytestmark = pytest.mark.django_db(transaction=True)


def test_first_request_runs_and_retry_replays(client, key):
    first = client.post("/api/widget/", {"name": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    second = client.post("/api/widget/", {"name": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 201, first.content
    assert first["Idempotent-Replay"] == "false"
    assert second.status_code == 201
    assert second["Idempotent-Replay"] == "true"
    assert second.content == first.content
    assert Widget.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == "COMPLETED"
