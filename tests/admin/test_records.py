"""The IdempotencyRecord admin through Django's test client: filters, actions, permissions."""

from __future__ import annotations

import importlib
import re
from datetime import timedelta

import pytest
from django.contrib import admin
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from django_idempotency.admin import MAX_INDENT_DEPTH, pretty_json
from django_idempotency.models import (
    FailedMessage,
    IdempotencyRecord,
    OutboxEvent,
    ProcessedMessage,
)
from tests.support.admin_support import login, messages_of, post_action
from tests.support.factories import IdempotencyRecordFactory

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_idempotency_idempotencyrecord_changelist"


def changelist(query: str = "") -> str:
    return reverse(CHANGELIST) + (f"?{query}" if query else "")


def detail(record: IdempotencyRecord) -> str:
    return reverse("admin:django_idempotency_idempotencyrecord_change", args=[record.pk])


@pytest.fixture
def superuser() -> Client:
    return login(superuser=True)


def shown_keys(response) -> set[str]:
    assert response.status_code == 200, response.content[:500]
    return {record.key for record in response.context["cl"].result_list}


def action(client: Client, name: str, records, query: str = "", **extra: str):
    return post_action(client, changelist(query), name, records, **extra)


@pytest.fixture
def records() -> dict[str, IdempotencyRecord]:
    return {
        "completed": IdempotencyRecordFactory(key="done"),
        "stuck": IdempotencyRecordFactory(key="stuck", stuck=True),
        "running": IdempotencyRecordFactory(key="running", running=True),
        "expired": IdempotencyRecordFactory(key="expired", expired=True),
        "old": IdempotencyRecordFactory(key="old", created_at=timezone.now() - timedelta(days=30)),
    }


# --- list, health, filters, search -----------------------------------------------------------


def test_changelist_lists_records_with_their_columns(superuser, records):
    response = superuser.get(changelist())
    assert shown_keys(response) == set(map(str, ["done", "stuck", "running", "expired", "old"]))
    html = response.content.decode()
    for header in ("Key", "Scope", "State", "Request", "Age"):
        assert f">{header}<" in html or f">{header}</a>" in html, header
    assert "Lease left" in html
    assert "expired 1\xa0minute ago" in html  # the stuck key's lease column
    assert "Completed · 201" in html
    assert "POST /api/payments/" in html
    # Stuck is said in words, in the alert colour; no column shows a tick or a cross.
    assert '<strong class="idempotency-alert">Stuck</strong>' in html
    assert "icon-yes" not in html
    assert "icon-no" not in html


def test_health_panel_shows_records_by_status_and_stuck_keys(superuser, records):
    response = superuser.get(changelist())
    section, _outbox = response.context["idempotency_health"].sections
    figures = {item["figure"].label: item for item in section["figures"]}
    assert figures["processing"]["figure"].value == "2"
    assert figures["completed"]["figure"].value == "3"
    assert figures["stuck"]["figure"].value == "1"
    assert figures["stuck"]["figure"].alert
    assert figures["stuck"]["url"] == changelist("stuck=yes")
    assert figures["stuck for"]["figure"].value == "1\xa0minute"
    assert figures["expired, awaiting sweep"]["figure"].value == "1"
    assert 'id="idempotency-health"' in response.content.decode()


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status__exact=PROCESSING", {"stuck", "running"}),
        ("status__exact=COMPLETED", {"done", "expired", "old"}),
        ("stuck=yes", {"stuck"}),
        ("stuck=no", {"done", "running", "expired", "old"}),
        ("expired=yes", {"expired"}),
        ("expired=no", {"done", "stuck", "running", "old"}),
    ],
)
def test_filters(superuser, records, query, expected):
    assert shown_keys(superuser.get(changelist(query))) == expected


def test_date_filter(superuser, records):
    response = superuser.get(changelist())
    (date_filter,) = [
        spec for spec in response.context["cl"].filter_specs if spec.title == "created at"
    ]
    choices = {
        choice["display"]: choice["query_string"]
        for choice in date_filter.choices(response.context["cl"])
    }
    past_week = superuser.get(reverse(CHANGELIST) + choices["Past 7 days"])
    assert shown_keys(past_week) == {"done", "stuck", "running", "expired"}


def test_search_matches_an_exact_key_or_scope(superuser, records):
    IdempotencyRecordFactory(key="done", scope="user:2")
    assert shown_keys(superuser.get(changelist("q=stuck"))) == {"stuck"}
    assert {r.scope for r in superuser.get(changelist("q=done")).context["cl"].result_list} == {
        "user:1",
        "user:2",
    }
    assert shown_keys(superuser.get(changelist("q=user:2"))) == {"done"}
    assert shown_keys(superuser.get(changelist("q=stu"))) == set()
    assert shown_keys(superuser.get(changelist("q=STUCK"))) == set()  # keys are case-sensitive


# --- detail page -------------------------------------------------------------------------------


def test_detail_page_is_read_only_and_pretty_prints_json(superuser):
    record = IdempotencyRecordFactory(response_body=b'{"id":7,"amount":"10.00"}')
    response = superuser.get(detail(record))
    html = response.content.decode()
    assert response.status_code == 200
    assert "{\n  &quot;amount&quot;: &quot;10.00&quot;,\n  &quot;id&quot;: 7\n}" in html
    assert record.fingerprint in html
    assert "Content-Type: application/json" in html  # stored headers, one per line
    assert str(record.owner_token) in html
    assert 'name="_save"' not in html
    assert "<textarea" not in html and 'name="key"' not in html  # no editable field
    assert superuser.post(detail(record), {"status": "COMPLETED"}).status_code == 403


@pytest.mark.parametrize(
    ("body", "headers", "shown"),
    [
        (b"<script>alert(1)</script>", [["Content-Type", "text/html"]], "&lt;script&gt;alert(1)"),
        (b"\xff\xfe\x00binary", [["Content-Type", "image/png"]], "9 bytes of binary data"),
        (b"not json {", [["Content-Type", "application/json"]], "not json {"),
        (b"", [], "(empty)"),
        (b"x" * (64 * 1024 + 10), [["Content-Type", "text/plain"]], "(65546 characters in all)"),
    ],
)
def test_detail_page_shows_other_bodies_safely(superuser, body, headers, shown):
    record = IdempotencyRecordFactory(response_body=body, response_headers=headers)
    html = superuser.get(detail(record)).content.decode()
    assert shown in html
    assert "<script>alert(1)" not in html


def test_detail_page_says_when_the_body_was_not_retained(superuser):
    record = IdempotencyRecordFactory(response_body=b"", response_retained=False)
    assert "Not retained" in superuser.get(detail(record)).content.decode()


def test_a_stuck_records_page_says_so_in_words_and_that_nothing_is_stored(superuser, records):
    html = superuser.get(detail(records["stuck"])).content.decode()
    assert "Yes: the lease expired 1\xa0minute ago." in html
    assert "Nothing stored: the request holding the key has not completed." in html
    for absent in ("icon-yes", "icon-no", "Response retained", "Response status", "(empty)"):
        assert absent not in html, absent


def test_a_running_records_page_is_not_stuck_and_stores_nothing_yet(superuser, records):
    html = superuser.get(detail(records["running"])).content.decode()
    assert '<div class="readonly">No</div>' in html
    assert "Nothing stored" in html
    assert "icon-yes" not in html


def test_a_completed_records_page_shows_the_response_and_no_tick(superuser, records):
    html = superuser.get(detail(records["completed"])).content.decode()
    assert "Response status" in html
    assert "&quot;amount&quot;: &quot;10.00&quot;" in html
    assert "icon-yes" not in html
    assert "Nothing stored" not in html


def test_a_deeply_nested_json_body_is_shown_as_stored_text(superuser):
    """A stored JSON body nested 950 deep is more than the JSON module can recurse through on
    Python 3.11 (and would indent into megabytes anywhere): the page shows the text as it was
    stored instead of failing."""
    body = b"[" * 950 + b"1" + b"]" * 950
    record = IdempotencyRecordFactory(response_body=body)
    response = superuser.get(detail(record))
    assert response.status_code == 200
    html = response.content.decode()
    assert '<pre class="idempotency-pre">' + "[" * 950 + "1" + "]" * 950 + "</pre>" in html


def test_json_is_indented_up_to_a_depth_then_compact_then_said_too_deep():
    def nested(depth: int) -> object:
        value: object = 1
        for _ in range(depth):
            value = [value]
        return value

    assert "\n" in pretty_json(nested(MAX_INDENT_DEPTH))
    assert pretty_json(nested(MAX_INDENT_DEPTH + 1)) == (
        '<pre class="idempotency-pre">'
        + "[" * (MAX_INDENT_DEPTH + 1)
        + "1"
        + "]" * (MAX_INDENT_DEPTH + 1)
        + "</pre>"
    )
    # Beyond any recursion limit: no encoder gets through it, and the page says so.
    assert "Nested too deep to show here." in pretty_json(nested(100_000))
    assert pretty_json({"a": [1]}) == (
        '<pre class="idempotency-pre">{\n  &quot;a&quot;: [\n    1\n  ]\n}</pre>'
    )


def release_form(html: str) -> dict[str, object]:
    """The hidden form that the page's release buttons submit, as fields to post."""
    pattern = r'<form id="idempotency-release-form"[^>]*action="([^"]+)".*?</form>'
    form = re.search(pattern, html, re.S)
    assert form is not None
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form[0]))
    return {"url": form[1], **fields}


def buttons(html: str) -> list[str]:
    return re.findall(r'form="idempotency-release-form" name="action" value="([^"]+)"', html)


def test_a_stuck_or_completed_records_page_releases_it(superuser, records, released):
    for name in ("stuck", "completed"):
        html = superuser.get(detail(records[name])).content.decode()
        assert buttons(html) == ["release_keys"]
        form = release_form(html)
        url = form.pop("url")
        assert url == changelist()
        response = superuser.post(url, {**form, "action": "release_keys"}, follow=True)
        assert messages_of(response) == ["success: Released 1 idempotency key."]
        assert not IdempotencyRecord.objects.filter(pk=records[name].pk).exists()
    assert sorted(key for _scope, key, _reason in released) == ["done", "stuck"]


def test_a_running_records_page_offers_the_force_release_which_asks_first(superuser, records):
    html = superuser.get(detail(records["running"])).content.decode()
    assert buttons(html) == ["force_release_keys"]
    form = release_form(html)
    url = form.pop("url")
    confirmation = superuser.post(url, {**form, "action": "force_release_keys"})
    assert confirmation.status_code == 200
    assert "Force release idempotency keys" in confirmation.content.decode()
    assert IdempotencyRecord.objects.filter(pk=records["running"].pk).exists()
    done = post_action(superuser, url, "force_release_keys", [records["running"]], post="yes")
    assert messages_of(done) == ["success: Released 1 idempotency key."]
    assert not IdempotencyRecord.objects.filter(pk=records["running"].pk).exists()


def test_no_release_button_without_the_delete_permission(records):
    viewer = login("view_idempotencyrecord")
    html = viewer.get(detail(records["stuck"])).content.decode()
    assert viewer.get(detail(records["stuck"])).status_code == 200
    assert buttons(html) == []
    assert "idempotency-release-form" not in html


def test_nothing_can_be_added_edited_or_deleted_by_form(superuser, records):
    record = records["completed"]
    assert (
        superuser.get(reverse("admin:django_idempotency_idempotencyrecord_add")).status_code == 403
    )
    delete_url = reverse("admin:django_idempotency_idempotencyrecord_delete", args=[record.pk])
    assert superuser.post(delete_url, {"post": "yes"}).status_code == 403
    actions = superuser.get(changelist()).context["action_form"].fields["action"].choices
    assert [name for name, _label in actions if name] == ["release_keys", "force_release_keys"]
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()


# --- actions -----------------------------------------------------------------------------------


def test_release_frees_stuck_and_completed_keys_and_refuses_a_running_lease(
    superuser, records, released
):
    chosen = [records["stuck"], records["completed"], records["running"]]
    response = action(superuser, "release_keys", chosen)
    assert messages_of(response) == [
        "success: Released 2 idempotency keys.",
        "warning: Refused 1 key whose lease is still running: a request may be working on it. "
        "Use “Force release” to release it anyway.",
    ]
    remaining = set(IdempotencyRecord.objects.values_list("key", flat=True))
    assert remaining == {"running", "expired", "old"}
    assert sorted(released) == [("user:1", "done", "admin"), ("user:1", "stuck", "admin")]


def test_release_reports_a_single_key_in_the_singular(superuser, records, released):
    response = action(superuser, "release_keys", [records["stuck"]])
    assert messages_of(response) == ["success: Released 1 idempotency key."]
    assert released == [("user:1", "stuck", "admin")]


def test_force_release_asks_for_confirmation_first(superuser, records, released):
    chosen = [records["running"], records["stuck"]]
    page = action(superuser, "force_release_keys", chosen)
    html = page.content.decode()
    assert page.status_code == 200
    assert "Force release idempotency keys" in html
    assert "1 selected key has a running lease." in html
    assert ">running</a>" in html
    assert IdempotencyRecord.objects.filter(key__in=["running", "stuck"]).count() == 2
    assert released == []

    confirmed = action(superuser, "force_release_keys", chosen, post="yes")
    assert messages_of(confirmed) == ["success: Released 2 idempotency keys."]
    assert not IdempotencyRecord.objects.filter(key__in=["running", "stuck"]).exists()
    assert sorted(released) == [("user:1", "running", "admin"), ("user:1", "stuck", "admin")]


def test_release_all_matching_a_filter(superuser, released):
    stuck = IdempotencyRecordFactory.create_batch(3, stuck=True)
    IdempotencyRecordFactory.create_batch(2)
    response = action(superuser, "release_keys", stuck[:1], query="stuck=yes", select_across="1")
    assert messages_of(response) == ["success: Released 3 idempotency keys."]
    assert IdempotencyRecord.objects.count() == 2
    assert len(released) == 3


# --- permissions -------------------------------------------------------------------------------


def test_view_permission_sees_records_but_cannot_act(records, released):
    client = login("view_idempotencyrecord")
    response = client.get(changelist())
    assert shown_keys(response)
    assert response.context["action_form"] is None
    assert client.get(detail(records["stuck"])).status_code == 200
    response = action(client, "release_keys", [records["stuck"]])
    assert response.status_code == 200 and messages_of(response) == []
    assert IdempotencyRecord.objects.filter(key="stuck").exists()
    assert released == []


def test_change_permission_alone_cannot_release(records):
    client = login("change_idempotencyrecord")
    assert client.get(changelist()).context["action_form"] is None
    assert client.get(detail(records["stuck"])).status_code == 200


def test_delete_permission_releases(records, released):
    client = login("view_idempotencyrecord", "delete_idempotencyrecord")
    response = action(client, "release_keys", [records["stuck"]])
    assert messages_of(response) == ["success: Released 1 idempotency key."]
    assert released == [("user:1", "stuck", "admin")]


def test_no_permission_no_page(records):
    client = login()
    assert client.get(changelist()).status_code == 403
    assert client.get(detail(records["stuck"])).status_code == 403


# --- registration ------------------------------------------------------------------------------


def test_registration_can_be_switched_off():
    from django_idempotency import admin as idempotency_admin

    models = (IdempotencyRecord, OutboxEvent, ProcessedMessage, FailedMessage)
    for model in models:
        admin.site.unregister(model)
    try:
        with override_settings(IDEMPOTENCY={"REGISTER_ADMIN": False}):
            importlib.reload(idempotency_admin)
        assert not any(admin.site.is_registered(model) for model in models)
        site = admin.AdminSite(name="custom")
        idempotency_admin.register(site)
        assert all(site.is_registered(model) for model in models)
    finally:
        if not admin.site.is_registered(IdempotencyRecord):
            importlib.reload(idempotency_admin)
    assert all(admin.site.is_registered(model) for model in models)


def test_a_record_handed_to_a_worker_is_shown_held_and_released_only_by_force(superuser, released):
    """ACCEPTED: its worker holds the key. The list says so; the plain release refuses it, as
    it refuses a running lease; the page offers only the forced release."""
    accepted = IdempotencyRecordFactory(key="with-worker", accepted=True)

    html = superuser.get(changelist()).content.decode()
    assert "Accepted · with a worker" in html
    assert buttons(superuser.get(detail(accepted)).content.decode()) == ["force_release_keys"]
    response = action(superuser, "release_keys", [accepted])
    assert any(m.startswith("warning: Refused 1 key") for m in messages_of(response)), messages_of(
        response
    )
    assert IdempotencyRecord.objects.filter(pk=accepted.pk).exists()
    assert released == []


# --- what the pages show -----------------------------------------------------------------------


def test_the_lease_time_shows_its_seconds(superuser):
    from datetime import UTC, datetime

    record = IdempotencyRecordFactory(
        running=True, lease_expires_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    )
    html = superuser.get(detail(record)).content.decode()
    assert "Jan. 2, 2030, 03:04:05 UTC" in html


def test_a_scope_may_wrap_after_a_colon_only(superuser):
    IdempotencyRecordFactory(key="anon", scope="anonymous")
    IdempotencyRecordFactory(key="digest", scope="credentials:" + "9f" * 20)
    html = superuser.get(changelist()).content.decode()
    assert '<td class="field-scope_display">anonymous</td>' in html
    assert f'<td class="field-scope_display">credentials:<wbr>{"9f" * 20}</td>' in html
    # The column's style lets no scope break inside a word.
    assert ".field-scope_display { overflow-wrap: normal;" in html
