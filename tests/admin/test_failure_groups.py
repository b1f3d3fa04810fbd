"""The failure groups page of the outbox admin, its confirmation pages and its filter, through
Django's test client."""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from django_idempotency.core.failures import fingerprint_of
from django_idempotency.models import OutboxEvent
from tests.support.admin_support import login, messages_of
from tests.support.factories import OutboxEventFactory

pytestmark = pytest.mark.django_db

REFUSED = "PublishError: webhook https://partner.example/hooks answered 503"
UNROUTABLE = "PublishError: unroutable: no queue bound for 'refunds.issued'"
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/app/publishers.py", line 12, in publish\n'
    "    raise PublishError(<script>)\n"
)


def groups_url(query: str = "") -> str:
    url = reverse("admin:django_idempotency_outboxevent_failures")
    return url + (f"?{query}" if query else "")


def group_url(fingerprint: str, action: str, query: str = "") -> str:
    url = reverse("admin:django_idempotency_outboxevent_failure_group", args=[fingerprint, action])
    return url + (f"?{query}" if query else "")


def events_url(query: str = "") -> str:
    url = reverse("admin:django_idempotency_outboxevent_changelist")
    return url + (f"?{query}" if query else "")


def failed(error: str = REFUSED, minutes: float = 30, **fields: Any) -> OutboxEvent:
    now = timezone.now()
    if not fields.pop("failing", False):
        fields["dead"] = True
    else:
        fields["failing"] = True
    return OutboxEventFactory(
        last_error=error,
        failure_fingerprint=fingerprint_of(error),
        failing_since=now - timedelta(minutes=minutes),
        last_failed_at=now - timedelta(minutes=minutes / 3),
        failure_traceback=TRACEBACK + error,
        **fields,
    )


def confirmation_form(response) -> dict[str, str]:
    """The hidden fields a confirmation page posts back."""
    html = response.content.decode()
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', html))


@pytest.fixture
def superuser() -> Client:
    return login(superuser=True)


@pytest.fixture
def groups() -> dict[str, list[OutboxEvent]]:
    return {
        "refused": [
            failed(topic="orders.paid", minutes=180),
            failed(topic="orders.paid", failing=True, minutes=90),
            failed(topic="invoices.sent", minutes=60),
        ],
        "unroutable": [failed(UNROUTABLE, topic="refunds.issued", minutes=6)],
        "fine": [OutboxEventFactory(), OutboxEventFactory(published=True, topic="orders.shipped")],
    }


def shown_groups(response) -> list[Any]:
    assert response.status_code == 200, response.content[:500]
    return [row["group"] for row in response.context["groups"]]


# --- the page ------------------------------------------------------------------------------------


def test_the_page_groups_failed_events_by_failure(superuser, groups):
    response = superuser.get(groups_url())
    unroutable, refused = shown_groups(response)
    assert unroutable.fingerprint == fingerprint_of(UNROUTABLE)  # seen most recently
    assert refused.signature == "PublishError: webhook https://partner.example/hooks answered <n>"
    assert (refused.events, refused.dead, refused.retrying, refused.topics) == (3, 2, 1, 2)
    assert refused.first_seen == groups["refused"][0].failing_since
    assert refused.last_seen == groups["refused"][2].last_failed_at
    assert refused.newest["pk"] == groups["refused"][2].pk
    html = response.content.decode()
    assert "invoices.sent and 1 more" in html
    assert "3\xa0hours ago" in html and "20\xa0minutes ago" in html  # first and last seen
    assert "2 dead, 1 retrying" in html
    # The newest traceback, escaped.
    assert "raise PublishError(&lt;script&gt;)" in html and "<script>" not in html
    refused_row = response.context["groups"][1]
    assert refused_row["events_url"] == events_url(f"failure={refused.fingerprint}")
    assert refused_row["requeue_url"] == group_url(refused.fingerprint, "requeue")
    assert f'href="{refused_row["discard_url"]}"' in html


def test_the_changelist_links_to_the_page(superuser, groups):
    html = superuser.get(events_url()).content.decode()
    assert f'href="{groups_url()}"' in html and ">Failure groups<" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("topic=orders.paid", {fingerprint_of(REFUSED): (2, 1)}),
        ("state=dead", {fingerprint_of(REFUSED): (2, 2), fingerprint_of(UNROUTABLE): (1, 1)}),
        ("state=retrying", {fingerprint_of(REFUSED): (1, 0)}),
        ("topic=orders.paid&state=dead", {fingerprint_of(REFUSED): (1, 1)}),
        ("topic=nothing.here", {}),
        ("state=bogus", {fingerprint_of(REFUSED): (3, 2), fingerprint_of(UNROUTABLE): (1, 1)}),
    ],
)
def test_the_page_filters_by_topic_and_state(superuser, groups, query, expected):
    response = superuser.get(groups_url(query))
    assert {g.fingerprint: (g.events, g.dead) for g in shown_groups(response)} == expected
    # The topics of failed events, and the chosen one.
    topics = response.context["topics"]
    assert {"invoices.sent", "orders.paid", "refunds.issued"} <= set(topics)
    assert topics == sorted(topics) and "orders.shipped" not in topics
    if not expected:
        assert "No failed events match the filter." in response.content.decode()


def test_a_filtered_groups_links_keep_the_filter(superuser, groups):
    response = superuser.get(groups_url("topic=orders.paid&state=dead"))
    (row,) = response.context["groups"]
    fingerprint = row["group"].fingerprint
    assert row["events_url"] == events_url(
        f"failure={fingerprint}&topic=orders.paid&status__exact=DEAD"
    )
    assert row["requeue_url"] == group_url(fingerprint, "requeue", "topic=orders.paid&state=dead")


def test_nothing_failed_says_so(superuser):
    OutboxEventFactory()
    response = superuser.get(groups_url())
    assert shown_groups(response) == []
    assert "No failed events: nothing waits for a person." in response.content.decode()


def test_many_groups_are_paged(superuser, monkeypatch):
    from django_idempotency.admin import failure_groups as admin

    monkeypatch.setattr(admin, "GROUPS_PER_PAGE", 2)
    for n, minutes in enumerate((10, 20, 30)):
        failed(f"PublishError: failure kind {'abc'[n]}", minutes=minutes)
    first = superuser.get(groups_url())
    assert [g.signature for g in shown_groups(first)] == [
        "PublishError: failure kind a",
        "PublishError: failure kind b",
    ]
    assert first.context["previous_url"] is None
    second = superuser.get(first.context["next_url"])
    assert [g.signature for g in shown_groups(second)] == ["PublishError: failure kind c"]
    assert second.context["next_url"] is None and second.context["previous_url"]


def test_failed_events_from_before_fingerprints_are_pointed_to(superuser):
    old = OutboxEventFactory(dead=True, last_error=REFUSED)  # an earlier relay failed it
    response = superuser.get(groups_url())
    assert shown_groups(response) == []
    html = response.content.decode()
    assert f'href="{events_url("failure=none")}"' in html
    listed = superuser.get(events_url("failure=none"))
    assert [event.pk for event in listed.context["cl"].result_list] == [old.pk]


# --- the events of a group, and an event's page --------------------------------------------------


def test_the_changelist_shows_one_group_and_names_it(superuser, groups):
    fingerprint = fingerprint_of(REFUSED)
    response = superuser.get(events_url(f"failure={fingerprint}"))
    assert {event.pk for event in response.context["cl"].result_list} == {
        event.pk for event in groups["refused"]
    }
    (spec,) = [s for s in response.context["cl"].filter_specs if s.title == "failure group"]
    assert spec.lookup_choices == [
        (fingerprint, "PublishError: webhook https://partner.example/hooks answered <n>")
    ]
    # Not offered until chosen: listing every group in the sidebar would group the table.
    unfiltered = superuser.get(events_url())
    assert [s.title for s in unfiltered.context["cl"].filter_specs if s.has_output()] == [
        "status",
        "failed",
        "failure kind",
        "topic",
    ]


def test_an_events_page_shows_its_failure(superuser, groups):
    event = groups["refused"][0]
    url = reverse("admin:django_idempotency_outboxevent_change", args=[event.pk])
    html = superuser.get(url).content.decode()
    assert "Failing since" in html and "Last failed at" in html
    assert f'href="{events_url(f"failure={event.failure_fingerprint}")}"' in html
    assert "raise PublishError(&lt;script&gt;)" in html
    fine = groups["fine"][0]
    url = reverse("admin:django_idempotency_outboxevent_change", args=[fine.pk])
    assert "Failing since" not in superuser.get(url).content.decode()


# --- requeue and discard -------------------------------------------------------------------------


def test_requeue_states_the_count_then_requeues(superuser, groups):
    fingerprint = fingerprint_of(REFUSED)
    page = superuser.get(group_url(fingerprint, "requeue"))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Requeue a failure group" in html
    assert "3 failed events will be sent again now (2 dead, 1 waiting for a retry)." in html
    for event in groups["refused"]:
        assert str(event.event_id) in html
    assert str(groups["unroutable"][0].event_id) not in html
    form = confirmation_form(page)
    assert form["shown"] == "3" and form["seen_at"]
    assert OutboxEvent.objects.failed().count() == 4  # nothing changed yet

    done = superuser.post(group_url(fingerprint, "requeue"), form, follow=True)
    assert done.redirect_chain[-1][0] == groups_url()
    assert messages_of(done) == ["success: Requeued 3 events of the failure group."]
    for event in groups["refused"]:
        event.refresh_from_db()
        assert (event.status, event.attempts, event.failure_fingerprint) == ("PENDING", 0, None)
    assert [g.fingerprint for g in shown_groups(done)] == [fingerprint_of(UNROUTABLE)]


def test_discard_part_of_a_group(superuser, groups):
    fingerprint = fingerprint_of(REFUSED)
    query = "topic=orders.paid&state=dead"
    page = superuser.get(group_url(fingerprint, "discard", query))
    html = page.content.decode()
    assert "Discard a failure group" in html
    assert "1 failed event will be deleted and never sent (1 dead, 0 waiting for a retry)." in html
    assert "Only the topic orders.paid." in html
    done = superuser.post(group_url(fingerprint, "discard"), confirmation_form(page), follow=True)
    assert messages_of(done) == ["success: Discarded 1 event of the failure group."]
    assert done.redirect_chain[-1][0] == groups_url(query)
    remaining = set(OutboxEvent.objects.values_list("pk", flat=True))
    assert groups["refused"][0].pk not in remaining
    assert {event.pk for event in groups["refused"][1:]} <= remaining


def test_a_requeue_of_a_group_that_changed_acts_on_what_still_matches_and_says_so(
    superuser, groups, caplog
):
    fingerprint = fingerprint_of(REFUSED)
    page = superuser.get(group_url(fingerprint, "requeue"))
    form = confirmation_form(page)
    assert form["shown"] == "3"
    published, failing_otherwise, still = groups["refused"]
    # While the operator reads the page: one event is published, one fails for another reason,
    # and a new one joins the group.
    OutboxEvent.objects.filter(pk=published.pk).update(
        status="PUBLISHED", published_at=timezone.now(), failure_fingerprint=None
    )
    OutboxEvent.objects.filter(pk=failing_otherwise.pk).update(
        last_error=UNROUTABLE, failure_fingerprint=fingerprint_of(UNROUTABLE)
    )
    joined = failed(minutes=-1)  # its group clock starts after the page was shown
    caplog.set_level(logging.INFO, logger="django_idempotency.admin")

    done = superuser.post(group_url(fingerprint, "requeue"), form, follow=True)
    assert messages_of(done) == [
        "success: Requeued 1 event of the failure group.",
        "warning: The group changed since the page was opened: 2 of the 3 events shown are no "
        "longer in it (published, retried, discarded, or failing for another reason) and were "
        "left alone.",
        "info: 1 event joined the group after the page was opened and was left alone; open the "
        "group again to act on it.",
    ]
    assert OutboxEvent.objects.get(pk=still.pk).status == "PENDING"
    assert OutboxEvent.objects.get(pk=published.pk).status == "PUBLISHED"
    assert OutboxEvent.objects.get(pk=failing_otherwise.pk).status == "PENDING"  # untouched
    assert OutboxEvent.objects.get(pk=failing_otherwise.pk).attempts == 2
    assert OutboxEvent.objects.get(pk=joined.pk).status == "DEAD"
    (record,) = [r for r in caplog.records if r.name == "django_idempotency.admin"]
    assert record.getMessage().startswith("outbox failure group requeue by user-")
    assert (record.outbox_count, record.outbox_shown, record.outbox_left) == (1, 3, 2)
    assert (record.outbox_joined, record.outbox_failure_group) == (1, fingerprint)


def test_an_event_a_relay_is_publishing_is_left_alone_and_reported(superuser):
    failed(failing=True)
    failed(failing=True, leased=True)
    fingerprint = fingerprint_of(REFUSED)
    form = confirmation_form(superuser.get(group_url(fingerprint, "requeue")))
    done = superuser.post(group_url(fingerprint, "requeue"), form, follow=True)
    assert messages_of(done) == [
        "success: Requeued 1 event of the failure group.",
        "warning: Left 1 event alone: a relay is publishing it right now.",
    ]


def test_an_emptied_group_has_nothing_to_confirm(superuser):
    response = superuser.get(group_url(fingerprint_of(REFUSED), "requeue"), follow=True)
    assert messages_of(response) == [
        "warning: No failed events are left in this failure group; nothing to do."
    ]
    assert response.redirect_chain[-1][0] == groups_url()


@pytest.mark.parametrize(
    ("fingerprint", "action"),
    [("0" * 31, "requeue"), ("Z" * 32, "requeue"), ("0" * 32, "delete"), ("0" * 33, "discard")],
)
def test_malformed_group_urls_are_not_found(superuser, fingerprint, action):
    assert superuser.get(group_url(fingerprint, action)).status_code == 404


@pytest.mark.parametrize(
    "form",
    [{}, {"seen_at": "yesterday", "shown": "3"}, {"seen_at": "2026-11-24T02:05:07", "shown": "3"}],
)
def test_a_confirmation_without_when_the_group_was_shown_changes_nothing(superuser, groups, form):
    done = superuser.post(group_url(fingerprint_of(REFUSED), "requeue"), form, follow=True)
    assert messages_of(done) == [
        "error: The confirmation did not say when the group was shown; nothing was changed. "
        "Open the group again."
    ]
    assert OutboxEvent.objects.failed().count() == 4


# --- permissions ---------------------------------------------------------------------------------


def test_view_permission_sees_the_groups_but_cannot_act(groups):
    client = login("view_outboxevent")
    response = client.get(groups_url())
    assert len(shown_groups(response)) == 2
    html = response.content.decode()
    assert "Requeue…" not in html and "Discard…" not in html
    fingerprint = fingerprint_of(REFUSED)
    for action in ("requeue", "discard"):
        assert client.get(group_url(fingerprint, action)).status_code == 403
        forged = {"seen_at": timezone.now().isoformat(), "shown": "3"}
        assert client.post(group_url(fingerprint, action), forged).status_code == 403
    assert OutboxEvent.objects.failed().count() == 4


def test_change_permission_requeues_and_delete_permission_discards(groups):
    fingerprint = fingerprint_of(REFUSED)
    changer = login("change_outboxevent")
    html = changer.get(groups_url()).content.decode()
    assert "Requeue…" in html and "Discard…" not in html
    assert changer.get(group_url(fingerprint, "discard")).status_code == 403
    assert changer.get(group_url(fingerprint, "requeue")).status_code == 200
    deleter = login("view_outboxevent", "delete_outboxevent")
    html = deleter.get(groups_url()).content.decode()
    assert "Discard…" in html and "Requeue…" not in html
    assert deleter.get(group_url(fingerprint, "requeue")).status_code == 403
    assert deleter.get(group_url(fingerprint, "discard")).status_code == 200


def test_no_permission_no_page(groups):
    client = login("view_idempotencyrecord")
    assert client.get(groups_url()).status_code == 403


# --- failed messages -----------------------------------------------------------------------------


def failed_message(message_id: str, error: str, consumer: str = "billing", minutes: float = 10):
    from django_idempotency.models import FailedMessage

    now = timezone.now()
    return FailedMessage.objects.create(
        consumer=consumer,
        message_id=message_id,
        attempts=2,
        last_error=error,
        failure_fingerprint=fingerprint_of(error),
        failing_since=now - timedelta(minutes=minutes),
        last_failed_at=now - timedelta(minutes=minutes / 2),
        failure_traceback=TRACEBACK + error,
    )


LEDGER_DOWN = "LedgerDown: ledger 10.0.0.7 refused entry 1041"


@pytest.fixture
def failed_messages() -> list[Any]:
    return [
        failed_message("m-1", LEDGER_DOWN, minutes=30),
        failed_message("m-2", "LedgerDown: ledger 10.0.0.8 refused entry 77", "ledger.post"),
        failed_message("m-3", "KeyError: 'account'", minutes=4),
    ]


def messages_url(query: str = "") -> str:
    url = reverse("admin:django_idempotency_failedmessage_changelist")
    return url + (f"?{query}" if query else "")


def test_the_page_groups_failed_messages_too(superuser, failed_messages):
    response = superuser.get(groups_url())
    rows = response.context["message_groups"]
    key_error, ledger = (row["group"] for row in rows)
    assert key_error.signature == "KeyError: 'account'"
    assert ledger.signature == "LedgerDown: ledger <n>.<n>.<n>.<n> refused entry <n>"
    assert (ledger.messages, ledger.consumers, ledger.consumer) == (2, 2, "billing")
    assert ledger.first_seen == failed_messages[0].failing_since
    assert rows[1]["messages_url"] == messages_url(f"failure={ledger.fingerprint}")
    html = response.content.decode()
    assert 'id="consumers"' in html and "billing and 1 more" in html
    assert "raise PublishError(&lt;script&gt;)" in html  # the newest traceback, escaped


def test_failed_messages_are_left_out_for_those_who_may_not_see_them(failed_messages):
    response = login("view_outboxevent").get(groups_url())
    assert response.context["message_groups"] is None
    assert 'id="consumers"' not in response.content.decode()
    both = login("view_outboxevent", "view_failedmessage").get(groups_url())
    assert len(both.context["message_groups"]) == 2


def test_forget_a_group_of_failed_messages_after_the_count(superuser, failed_messages):
    from django_idempotency.models import FailedMessage
    from tests.support.admin_support import post_action

    fingerprint = fingerprint_of(LEDGER_DOWN)
    listed = superuser.get(messages_url(f"failure={fingerprint}"))
    assert {m.message_id for m in listed.context["cl"].result_list} == {"m-1", "m-2"}
    (spec,) = [s for s in listed.context["cl"].filter_specs if s.title == "failure group"]
    assert spec.lookup_choices == [
        (fingerprint, "LedgerDown: ledger <n>.<n>.<n>.<n> refused entry <n>")
    ]
    url = messages_url(f"failure={fingerprint}")
    page = post_action(superuser, url, "forget_failures", failed_messages[:1], select_across="1")
    html = page.content.decode()
    assert "2 failed messages are selected; the latest 20 are listed." in html
    assert FailedMessage.objects.count() == 3
    done = post_action(
        superuser, url, "forget_failures", failed_messages[:1], select_across="1", post="yes"
    )
    assert messages_of(done) == ["success: Forgot 2 failed messages."]
    assert list(FailedMessage.objects.values_list("message_id", flat=True)) == ["m-3"]


def test_a_failed_messages_page_is_read_only(superuser, failed_messages):
    message = failed_messages[0]
    url = reverse("admin:django_idempotency_failedmessage_change", args=[message.pk])
    html = superuser.get(url).content.decode()
    assert "ledger 10.0.0.7 refused entry 1041" in html
    assert "raise PublishError(&lt;script&gt;)" in html
    assert 'name="_save"' not in html
    assert superuser.post(url, {"attempts": "0"}).status_code == 403
    add = reverse("admin:django_idempotency_failedmessage_add")
    assert superuser.get(add).status_code == 403


def test_forgetting_needs_the_delete_permission(failed_messages):
    from django_idempotency.models import FailedMessage
    from tests.support.admin_support import post_action

    viewer = login("view_failedmessage")
    response = viewer.get(messages_url())
    assert response.status_code == 200 and response.context["action_form"] is None
    forged = post_action(viewer, messages_url(), "forget_failures", failed_messages, post="yes")
    assert messages_of(forged) == []
    assert FailedMessage.objects.count() == 3
