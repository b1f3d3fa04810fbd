"""The OutboxEvent and ProcessedMessage admins through Django's test client."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_idempotency.models import OutboxEvent, ProcessedMessage
from django_idempotency.testing import OutboxRecorder
from tests.support.admin_support import login, messages_of, post_action
from tests.support.factories import OutboxEventFactory, ProcessedMessageFactory
from tests.support.outbox_support import held_by_a_running_relay

pytestmark = pytest.mark.django_db

PENDING, PUBLISHED, DEAD = (OutboxEvent.Status.PENDING, OutboxEvent.Status.PUBLISHED, "DEAD")


def events_url(query: str = "") -> str:
    url = reverse("admin:django_idempotency_outboxevent_changelist")
    return url + (f"?{query}" if query else "")


def messages_url(query: str = "") -> str:
    url = reverse("admin:django_idempotency_processedmessage_changelist")
    return url + (f"?{query}" if query else "")


def event_detail(event: OutboxEvent) -> str:
    return reverse("admin:django_idempotency_outboxevent_change", args=[event.pk])


def shown(response) -> set[str]:
    """The topics (events) or message ids (processed messages) on a changelist page."""
    assert response.status_code == 200, response.content[:500]
    return {
        getattr(row, "message_id", None) or row.key for row in response.context["cl"].result_list
    }


def action_names(response) -> list[str]:
    form = response.context["action_form"]
    return [] if form is None else [name for name, _label in form.fields["action"].choices if name]


@pytest.fixture
def superuser() -> Client:
    return login(superuser=True)


@pytest.fixture
def events() -> dict[str, OutboxEvent]:
    """One event in each state an operator meets; the key names the state."""
    return {
        "fresh": OutboxEventFactory(key="fresh", topic="orders.paid"),
        "failing": OutboxEventFactory(key="failing", topic="orders.paid", failing=True),
        "leased": OutboxEventFactory(key="leased", topic="orders.paid", leased=True, attempts=1),
        "dead": OutboxEventFactory(key="dead", topic="invoices.sent", dead=True),
        "published": OutboxEventFactory(key="published", topic="orders.shipped", published=True),
    }


def retry(client, chosen, query: str = "", **extra: str):
    return post_action(client, events_url(query), "retry_events", chosen, **extra)


def discard(client, chosen, query: str = "", **extra: str):
    return post_action(client, events_url(query), "discard_events", chosen, **extra)


# --- outbox: list, health, filters, search -------------------------------------------------------


def test_changelist_lists_events_with_their_state(superuser, events):
    response = superuser.get(events_url())
    assert shown(response) == set(events)
    html = response.content.decode()
    for header in ("Event id", "Topic", "Key", "State", "Age", "Next attempt", "Last error"):
        assert f">{header}<" in html or f">{header}</a>" in html, header
    # The state carries the failed attempts; a dead event's in the alert colour.
    assert '<strong class="idempotency-alert">Dead</strong> · 10 failed attempts' in html
    assert "Pending · 2 failed attempts" in html
    assert "none: waits for a person" in html  # the dead event
    assert "being published now" in html  # the leased one
    assert "in 4\xa0minutes" in html  # the failing one, backing off
    assert "due now" in html and "published 1\xa0minute ago" in html
    assert "PublishError: the broker said no" in html  # last error column


def test_health_panel_shows_the_outbox(superuser, events):
    OutboxEventFactory(created_at=timezone.now() - timedelta(hours=2))
    response = superuser.get(events_url())
    sections = {
        section["title"]: section for section in response.context["idempotency_health"].sections
    }
    figures = {item["figure"].label: item for item in sections["Outbox"]["figures"]}
    assert figures["pending"]["figure"].value == "4"
    assert figures["pending"]["url"] == events_url("status__exact=PENDING")
    assert figures["oldest pending"]["figure"].value == "2\xa0hours"
    assert figures["oldest pending"]["figure"].alert  # older than a relay lease
    assert figures["dead"]["figure"].value == "1"
    assert figures["dead"]["figure"].alert
    assert figures["dead"]["url"] == events_url("status__exact=DEAD")
    assert "Idempotency keys" in sections  # the other layers' sections are there too


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status__exact=PENDING", {"fresh", "failing", "leased"}),
        ("status__exact=PUBLISHED", {"published"}),
        ("status__exact=DEAD", {"dead"}),
        ("failed=yes", {"failing", "leased", "dead"}),
        ("topic=orders.paid", {"fresh", "failing", "leased"}),
        ("topic=invoices.sent", {"dead"}),
        ("topic=orders.paid&status__exact=PENDING&failed=yes", {"failing", "leased"}),
    ],
)
def test_filters(superuser, events, query, expected):
    assert shown(superuser.get(events_url(query))) == expected


def test_topic_filter_offers_recent_and_unpublished_topics_without_reading_the_table(
    superuser, events, monkeypatch
):
    from django_idempotency.admin import TopicFilter

    monkeypatch.setattr(TopicFilter, "sample_size", 2)  # the latest 2, and 2 unpublished
    OutboxEventFactory(topic="zz.latest", published=True)
    response = superuser.get(events_url("topic=chosen.by.link"))
    (topics,) = [spec for spec in response.context["cl"].filter_specs if spec.title == "topic"]
    offered = [value for value, _label in topics.lookup_choices]
    # Unpublished: the first two of orders.paid x3 and invoices.sent; latest: zz.latest and the
    # published orders.shipped. The chosen topic is offered even when no sample has it.
    assert "zz.latest" in offered and "orders.shipped" in offered
    assert "chosen.by.link" in offered
    assert offered == sorted(offered)
    assert shown(response) == set()


def test_search_matches_an_exact_event_id_or_key(superuser, events):
    dead = events["dead"]
    assert shown(superuser.get(events_url(f"q={dead.event_id}"))) == {"dead"}
    assert shown(superuser.get(events_url("q=failing"))) == {"failing"}
    assert shown(superuser.get(events_url("q=fail"))) == set()
    assert shown(superuser.get(events_url(f"q={uuid.uuid4()}"))) == set()


# --- outbox: detail ------------------------------------------------------------------------------


def test_detail_page_is_read_only_and_pretty_prints(superuser):
    event = OutboxEventFactory(
        dead=True,
        payload={"order_id": 7, "note": "<script>alert(1)</script>"},
        headers={"tenant": "acme"},
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        last_error="PublishError: unroutable: no queue bound for 'orders.paid'",
    )
    response = superuser.get(event_detail(event))
    html = response.content.decode()
    assert response.status_code == 200
    assert "&quot;order_id&quot;: 7" in html and "{\n  &quot;note&quot;" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html
    assert "{\n  &quot;tenant&quot;: &quot;acme&quot;\n}" in html
    assert "no queue bound for &#x27;orders.paid&#x27;" in html
    assert "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" in html
    # An internal ordering column, 0 on most databases: not business data, not shown.
    assert "Transaction id" not in html
    assert 'name="_save"' not in html and "<textarea" not in html
    assert superuser.post(event_detail(event), {"status": "PENDING"}).status_code == 403
    event.refresh_from_db()
    assert event.status == DEAD


def test_nothing_can_be_added_or_deleted_by_form(superuser, events):
    event = events["dead"]
    assert superuser.get(reverse("admin:django_idempotency_outboxevent_add")).status_code == 403
    delete_url = reverse("admin:django_idempotency_outboxevent_delete", args=[event.pk])
    assert superuser.post(delete_url, {"post": "yes"}).status_code == 403
    assert action_names(superuser.get(events_url())) == ["retry_events", "discard_events"]
    assert OutboxEvent.objects.filter(pk=event.pk).exists()


# --- outbox: actions -----------------------------------------------------------------------------


def test_retry_sends_dead_and_failing_events_again_and_leaves_the_rest(superuser, events):
    response = retry(superuser, events.values())
    assert messages_of(response) == [
        "success: Queued 2 failed events to be sent again.",
        "warning: Left 1 event alone: a relay is publishing it right now.",
        "info: Left 2 events alone: they have not failed (published, or waiting for their "
        "first attempt).",
    ]
    now = timezone.now()
    for name in ("dead", "failing"):
        event = OutboxEvent.objects.get(pk=events[name].pk)
        assert (event.status, event.attempts) == (PENDING, 0)
        assert event.next_attempt_at <= now and event.locked_until is None
    leased = OutboxEvent.objects.get(pk=events["leased"].pk)
    assert leased.relay_token == events["leased"].relay_token  # untouched
    assert OutboxEvent.objects.get(pk=events["published"].pk).status == PUBLISHED
    # The relay takes them as it takes any due event.
    recorder = OutboxRecorder()
    recorder.clear()
    with held_by_a_running_relay(leased):
        assert recorder.relay().published == 3  # dead, failing and fresh; leased is not due
    assert {message.key for message in recorder.messages} == {"dead", "failing", "fresh"}
    recorder.clear()


def test_retry_reports_one_event_in_the_singular(superuser, events):
    response = retry(superuser, [events["dead"]])
    assert messages_of(response) == ["success: Queued 1 failed event to be sent again."]


def test_retry_of_nothing_failed_says_so(superuser, events):
    response = retry(superuser, [events["published"]])
    assert messages_of(response) == [
        "warning: Queued 0 failed events to be sent again.",
        "info: Left 1 event alone: it has not failed (published, or waiting for its first "
        "attempt).",
    ]


def test_retry_all_matching_a_filter(superuser):
    dead = OutboxEventFactory.create_batch(3, dead=True)
    OutboxEventFactory.create_batch(2)
    response = retry(superuser, dead[:1], query="status__exact=DEAD", select_across="1")
    assert messages_of(response) == ["success: Queued 3 failed events to be sent again."]
    assert not OutboxEvent.objects.dead().exists()


def test_discard_asks_first_then_deletes_only_failed_events(superuser, events):
    page = discard(superuser, events.values())
    html = page.content.decode()
    assert page.status_code == 200
    assert "Discard outbox events" in html
    assert "3 selected events have failed; the first 20 are listed." in html
    assert str(events["dead"].event_id) in html and "the broker said no" in html
    assert str(events["fresh"].event_id) not in html
    assert OutboxEvent.objects.count() == 5

    confirmed = discard(superuser, events.values(), post="yes")
    assert messages_of(confirmed) == [
        "success: Discarded 2 failed events.",
        "warning: Left 1 event alone: a relay is publishing it right now.",
        "info: Left 2 events alone: they have not failed (published, or waiting for their "
        "first attempt).",
    ]
    remaining = set(OutboxEvent.objects.values_list("key", flat=True))
    assert remaining == {"fresh", "leased", "published"}


# --- outbox: permissions -------------------------------------------------------------------------


def test_view_permission_sees_events_but_cannot_act(events):
    client = login("view_outboxevent")
    response = client.get(events_url())
    assert shown(response) == set(events)
    assert action_names(response) == []
    assert client.get(event_detail(events["dead"])).status_code == 200
    for forged in (retry(client, [events["dead"]]), discard(client, [events["dead"]], post="yes")):
        assert forged.status_code == 200 and messages_of(forged) == []
    assert OutboxEvent.objects.get(pk=events["dead"].pk).status == DEAD


def test_change_permission_retries_but_cannot_discard(events):
    client = login("change_outboxevent")
    assert action_names(client.get(events_url())) == ["retry_events"]
    assert client.get(event_detail(events["dead"])).status_code == 200
    forged = discard(client, [events["dead"]], post="yes")
    assert messages_of(forged) == ["warning: No action selected."]  # not offered to them
    assert OutboxEvent.objects.filter(pk=events["dead"].pk).exists()
    retried = retry(client, [events["dead"]])
    assert messages_of(retried) == ["success: Queued 1 failed event to be sent again."]


def test_delete_permission_discards_but_cannot_retry(events):
    client = login("view_outboxevent", "delete_outboxevent")
    assert action_names(client.get(events_url())) == ["discard_events"]
    assert messages_of(retry(client, [events["dead"]])) == ["warning: No action selected."]
    assert OutboxEvent.objects.get(pk=events["dead"].pk).status == DEAD
    discarded = discard(client, [events["dead"]], post="yes")
    assert messages_of(discarded) == ["success: Discarded 1 failed event."]


def test_no_permission_no_page(events):
    client = login("view_idempotencyrecord")
    assert client.get(events_url()).status_code == 403
    assert client.get(event_detail(events["dead"])).status_code == 403


# --- processed messages --------------------------------------------------------------------------


@pytest.fixture
def markers() -> dict[str, ProcessedMessage]:
    return {
        "m-1": ProcessedMessageFactory(message_id="m-1", consumer="billing"),
        "m-2": ProcessedMessageFactory(message_id="m-2", consumer="shipping"),
        "m-old": ProcessedMessageFactory(
            message_id="m-old", consumer="billing", processed_at=timezone.now() - timedelta(days=30)
        ),
    }


def test_processed_messages_are_listed_filtered_and_searched(superuser, markers):
    response = superuser.get(messages_url())
    assert shown(response) == {"m-1", "m-2", "m-old"}
    assert action_names(response) == []  # read-only: no action at all
    html = response.content.decode()
    for header in ("Consumer", "Message id", "Processed at", "Age"):
        assert f">{header}<" in html or f">{header}</a>" in html, header
    (consumers,) = [s for s in response.context["cl"].filter_specs if s.title == "consumer"]
    assert [value for value, _label in consumers.lookup_choices] == ["billing", "shipping"]
    assert shown(superuser.get(messages_url("consumer=billing"))) == {"m-1", "m-old"}
    (dates,) = [s for s in response.context["cl"].filter_specs if s.title == "processed at"]
    week = {c["display"]: c["query_string"] for c in dates.choices(response.context["cl"])}
    assert shown(superuser.get(messages_url() + week["Past 7 days"])) == {"m-1", "m-2"}
    assert shown(superuser.get(messages_url("q=m-2"))) == {"m-2"}
    assert shown(superuser.get(messages_url("q=shipping"))) == {"m-2"}
    assert shown(superuser.get(messages_url("q=m-"))) == set()


def test_processed_messages_are_read_only(superuser, markers):
    marker = markers["m-1"]
    url = reverse("admin:django_idempotency_processedmessage_change", args=[marker.pk])
    html = superuser.get(url).content.decode()
    assert "billing" in html and "m-1" in html
    assert 'name="_save"' not in html and 'name="message_id"' not in html
    assert superuser.post(url, {"message_id": "other"}).status_code == 403
    add = reverse("admin:django_idempotency_processedmessage_add")
    assert superuser.get(add).status_code == 403
    delete = reverse("admin:django_idempotency_processedmessage_delete", args=[marker.pk])
    assert superuser.post(delete, {"post": "yes"}).status_code == 403
    forged = post_action(superuser, messages_url(), "delete_selected", [marker], post="yes")
    assert forged.status_code == 200
    assert ProcessedMessage.objects.get(pk=marker.pk).message_id == "m-1"


def test_processed_messages_need_the_view_permission(markers):
    assert login("view_processedmessage").get(messages_url()).status_code == 200
    assert login("view_outboxevent").get(messages_url()).status_code == 403


def test_the_relay_times_show_their_seconds(superuser):
    from datetime import UTC, datetime

    event = OutboxEventFactory(
        failing=True,
        next_attempt_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC),
        locked_until=datetime(2030, 1, 2, 3, 4, 6, tzinfo=UTC),
    )
    url = reverse("admin:django_idempotency_outboxevent_change", args=[event.pk])
    html = superuser.get(url).content.decode()
    assert "Jan. 2, 2030, 03:04:05 UTC" in html
    assert "Jan. 2, 2030, 03:04:06 UTC" in html
