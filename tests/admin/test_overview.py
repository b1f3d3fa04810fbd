"""The admin's overview page: the last 24 hours hour by hour, by the database's clock.

Rows are written at known hours of the window the page reads (its hours start at the
database's time, which freezegun cannot move); the counts per hour are checked in the queries'
results, in the charts the page draws and in the tables under them. The browser's view of the
page (the charts drawn, the screenshot) is in ``tests/admin/test_browser.py``.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from django_idempotency import signals
from django_idempotency.admin.charts import Chart, Series, format_seconds
from django_idempotency.core.failures import fingerprint_of, normalise
from django_idempotency.db.indexes import RECORD_CREATED_INDEX
from django_idempotency.db.querysets import OutboxStatus
from django_idempotency.models import FailedMessage, IdempotencyRecord
from django_idempotency.operations import overview
from tests.support.admin_support import login
from tests.support.factories import IdempotencyRecordFactory, OutboxEventFactory

pytestmark = pytest.mark.django_db

OVERVIEW = "admin:django_idempotency_idempotencyrecord_overview"
HOURS = overview.WINDOW_HOURS


@pytest.fixture
def window() -> overview.Window:
    return overview.window()


@pytest.fixture
def superuser() -> Client:
    return login(superuser=True)


def charts(response) -> dict[str, Chart]:
    assert response.status_code == 200, response.content[:500]
    return {
        item["chart"].key: item["chart"]
        for section in response.context["sections"]
        for item in section["charts"]
    }


def values(chart: Chart) -> dict[str, tuple[float | None, ...]]:
    return {series.label: series.values for series in chart.series}


def at(*pairs: tuple[int, int]) -> tuple[int, ...]:
    """A 24-hour series that is zero but for (hour index, count) pairs."""
    counts = [0] * HOURS
    for index, count in pairs:
        counts[index] += count
    return tuple(counts)


# --- the page, who sees it, where it is linked from ------------------------------------------


def test_the_overview_renders_for_staff_with_every_chart_and_is_linked(superuser, window):
    IdempotencyRecordFactory(created_at=window.hours[-1])
    OutboxEventFactory(created_at=window.hours[-1])
    response = superuser.get(reverse(OVERVIEW))
    assert set(charts(response)) == {"outcomes", "conflicts", "backlog", "lag", "dead", "failures"}
    html = response.content.decode()
    assert 'id="idempotency-health"' in html  # the health panel on top
    content = html.split('<div id="content-main">')[1].split("idempotency-overview-timing")[0]
    assert content.count('<svg xmlns="http://www.w3.org/2000/svg"') == 2  # outcomes, backlog
    assert "<script" not in content  # drawn on the server
    assert "http" not in content.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no CDN
    assert re.search(r"Read at .* in \d+ ms", html)

    url = reverse(OVERVIEW)
    for page in (reverse("admin:index"), reverse("admin:app_list", args=["django_idempotency"])):
        assert f'href="{url}"' in superuser.get(page).content.decode(), page
    # And from the health panel of every changelist of the app.
    changelist = reverse("admin:django_idempotency_outboxevent_changelist")
    assert f'href="{url}"' in superuser.get(changelist).content.decode()


def test_the_overview_is_refused_to_anyone_but_staff_who_may_see_the_records(window):
    url = reverse(OVERVIEW)
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    user = User.objects.create_user("customer", password="pw")  # not staff
    client = Client()
    client.force_login(user)
    refused = client.get(url)
    assert refused.status_code == 302 and "/admin/login/" in refused["Location"]
    assert login().get(url).status_code == 403  # staff without the records' permission
    # Nor is the link shown to them, on the index or in the health panel of what they see.
    assert url not in login().get(reverse("admin:index")).content.decode()
    outbox_only = login("view_outboxevent")
    changelist = outbox_only.get(reverse("admin:django_idempotency_outboxevent_changelist"))
    assert changelist.status_code == 200 and url not in changelist.content.decode()


def test_records_alone_show_the_records_charts_only(window):
    OutboxEventFactory(created_at=window.hours[-1])
    response = login("view_idempotencyrecord").get(reverse(OVERVIEW))
    assert set(charts(response)) == {"outcomes", "conflicts"}
    assert "Outbox" not in [section["title"] for section in response.context["sections"]]


def test_a_site_with_its_own_index_template_keeps_it():
    site = admin.AdminSite(name="custom")
    site.index_template = "custom/index.html"
    from django_idempotency.admin import register

    register(site)
    assert site.index_template == "custom/index.html"
    bare = admin.AdminSite(name="bare")
    register(bare)
    assert bare.index_template == "admin/django_idempotency/index.html"


def test_the_empty_state_says_so_chart_by_chart(superuser):
    response = superuser.get(reverse(OVERVIEW))
    shown = charts(response)
    assert all(chart.empty for chart in shown.values())
    html = response.content.decode()
    assert 'class="idempotency-chart-svg"' not in html
    assert "No request claimed a key in the last 24 hours." in html
    assert "No event waited and none was published in the last 24 hours." in html
    assert "Nothing failed in the last 24 hours." in html
    assert "0 keys are held right now" in html


# --- the records: by outcome, 409s --------------------------------------------------------------


def test_records_are_counted_in_the_hour_they_were_claimed_by_outcome(superuser, window):
    hours = window.hours
    IdempotencyRecordFactory.create_batch(3, created_at=hours[2])
    IdempotencyRecordFactory(created_at=hours[2] + timedelta(minutes=59))
    IdempotencyRecordFactory(created_at=hours[2], response_status=422)
    IdempotencyRecordFactory(created_at=hours[5], response_status=409)
    IdempotencyRecordFactory(created_at=hours[5], response_status=409, attempts=2)
    IdempotencyRecordFactory(created_at=hours[20], stuck=True, attempts=3)
    IdempotencyRecordFactory(created_at=hours[23], running=True)
    IdempotencyRecordFactory.create_batch(2, created_at=hours[23], accepted=True)
    # Before the window: not counted.
    IdempotencyRecordFactory(created_at=hours[0] - timedelta(seconds=1))

    counted = overview.record_hours(window)
    assert counted.outcomes == {
        "succeeded": at((2, 4)),
        "refused": at((2, 1)),
        "conflict": at((5, 2)),
        "accepted": at((23, 2)),
        "in_flight": at((23, 1)),
        "stuck": at((20, 1)),
    }
    assert counted.taken_over == at((5, 1), (20, 1))
    assert counted.total == 11

    shown = charts(superuser.get(reverse(OVERVIEW)))
    assert values(shown["outcomes"]) == {
        "succeeded": at((2, 4)),
        "refused (4xx)": at((2, 1), (5, 2)),
        "handed to a worker": at((23, 2)),
        "in flight": at((23, 1)),
        "stuck": at((20, 1)),
    }
    assert values(shown["conflicts"]) == {
        "409 stored": at((5, 2)),
        "taken over": at((5, 1), (20, 1)),
    }
    table = shown["outcomes"].rows()
    assert table[2]["values"] == ["4", "1", "0", "0", "0"]
    assert table[-1]["hour"].endswith("–now")


def test_the_409_chart_says_how_many_keys_are_held_and_what_prometheus_counted(superuser, window):
    IdempotencyRecordFactory(created_at=window.hours[-1], running=True)
    IdempotencyRecordFactory(created_at=window.hours[-1], accepted=True)
    IdempotencyRecordFactory(created_at=window.hours[-1], stuck=True)  # a retry takes it over
    before = overview.conflicts_counted()
    assert before is not None and before.scope == "process"
    signals.request_conflicted.send(sender=None, scope="s", key="k", retry_after=1)
    html = superuser.get(reverse(OVERVIEW)).content.decode()
    assert "2 keys are held right now: a retry of any of them is answered 409." in html
    assert "409s answered to duplicates in flight, counted by this server process" in html
    assert overview.conflicts_counted() == overview.ConflictCount(before.value + 1, "process")


def test_under_multiprocess_mode_the_count_is_every_worker_s(monkeypatch, tmp_path):
    # The counters of this host's workers are files there; none have counted yet.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert overview.conflicts_counted() == overview.ConflictCount(0, "host")


def test_without_metrics_no_prometheus_figure_is_shown(settings):
    settings.IDEMPOTENCY = {"METRICS": False}
    assert overview.conflicts_counted() is None


# --- the outbox: backlog, lag, dead ----------------------------------------------------------


def test_the_backlog_is_what_was_pending_at_each_hours_end(window):
    hours = window.hours
    OutboxEventFactory(created_at=hours[0] - timedelta(hours=30))  # pending for long
    OutboxEventFactory(
        created_at=hours[5],
        status=OutboxStatus.PUBLISHED,
        published_at=hours[8] + timedelta(minutes=30),
    )
    OutboxEventFactory(created_at=hours[10], dead=True, last_failed_at=hours[12])
    OutboxEventFactory.create_batch(3, created_at=hours[20])
    # Written and published within one hour: never pending at an hour's end.
    OutboxEventFactory(created_at=hours[15], status=OutboxStatus.PUBLISHED, published_at=hours[15])
    # Published before the window, dead before it: out of it.
    OutboxEventFactory(
        created_at=hours[0] - timedelta(hours=3),
        status=OutboxStatus.PUBLISHED,
        published_at=hours[0] - timedelta(hours=2),
    )
    OutboxEventFactory(created_at=hours[0] - timedelta(hours=3), dead=True, last_failed_at=None)

    counted = overview.outbox_hours(window)
    expected = [1] * HOURS
    for index in (5, 6, 7, 10, 11):
        expected[index] += 1
    for index in range(20, HOURS):
        expected[index] += 3
    assert counted.backlog == tuple(expected)
    assert counted.published == at((8, 1), (15, 1))
    assert counted.dead == at((12, 1))


def test_the_lag_is_from_publish_to_the_broker_per_hour_published(superuser, window):
    hours = window.hours
    lags = [1, 2, 3, 4, 100]  # seconds, all published in hour 3
    for seconds in lags:
        OutboxEventFactory(
            created_at=hours[3] - timedelta(seconds=seconds),
            status=OutboxStatus.PUBLISHED,
            published_at=hours[3],
        )
    OutboxEventFactory(
        created_at=hours[22] - timedelta(milliseconds=40),
        status=OutboxStatus.PUBLISHED,
        published_at=hours[22],
    )
    counted = overview.outbox_hours(window)
    assert counted.lag_max[3] == timedelta(seconds=100)
    assert counted.lag_max[22] == timedelta(milliseconds=40)
    assert counted.lag_max[4] is None  # nothing published then
    postgresql = connection.vendor == "postgresql"
    assert counted.percentiles is postgresql
    if postgresql:
        assert counted.lag_p50[3] == timedelta(seconds=3)
        assert counted.lag_p95[3] == timedelta(seconds=4 + 0.8 * 96)  # interpolated
    else:
        assert counted.lag_p50 == (None,) * HOURS

    response = superuser.get(reverse(OVERVIEW))
    lag = charts(response)["lag"]
    assert lag.seconds and values(lag)["slowest"][3] == 100.0
    html = response.content.decode()
    assert 'id="idempotency-chart-lag-svg"' in html
    assert escape("slowest: 1.7 min") in html  # the point's title
    if not postgresql:
        assert "computed on PostgreSQL only" in html


def test_dead_events_are_counted_in_the_hour_they_went_dead(superuser, window):
    hours = window.hours
    OutboxEventFactory.create_batch(2, created_at=hours[1], dead=True, last_failed_at=hours[4])
    OutboxEventFactory(created_at=hours[1], dead=True, last_failed_at=hours[23])
    shown = charts(superuser.get(reverse(OVERVIEW)))
    assert values(shown["dead"]) == {"went dead": at((4, 2), (23, 1))}
    assert "3 events are dead now." in superuser.get(reverse(OVERVIEW)).content.decode()


# --- failure groups ---------------------------------------------------------------------------


def test_failures_are_grouped_by_failure_group_in_the_hour_of_their_latest_failure(
    superuser, window
):
    hours = window.hours
    timeout = "ReadTimeout: partner 10.0.0.7 did not answer within 5.0 s"
    unroutable = "PublishError: unroutable: no queue bound for 'refunds.issued'"
    for _ in range(3):
        OutboxEventFactory(
            dead=True,
            last_error=timeout,
            failure_fingerprint=fingerprint_of(timeout),
            last_failed_at=hours[3],
        )
    OutboxEventFactory(
        failing=True,
        last_error=unroutable,
        failure_fingerprint=fingerprint_of(unroutable),
        last_failed_at=hours[20],
    )
    lookup = "LookupError: no ledger account for customer 4242"
    for n in range(2):
        FailedMessage.objects.create(
            consumer="ledger.post",
            message_id=f"msg-{n}",
            last_error=lookup,
            failure_fingerprint=fingerprint_of(lookup),
            failing_since=hours[22],
            last_failed_at=hours[22],
        )
    # Failed before the window: not drawn.
    OutboxEventFactory(
        dead=True,
        last_error=timeout,
        failure_fingerprint=fingerprint_of(timeout),
        last_failed_at=hours[0] - timedelta(minutes=1),
    )

    counted = overview.failure_hours(window, top=2)
    assert [(g.kind, g.signature, g.failures) for g in counted.groups] == [
        ("event", normalise(timeout), at((3, 3))),
        ("message", normalise(lookup), at((22, 2))),
    ]
    assert counted.other == at((20, 1))
    assert counted.groups_per_hour == at((3, 1), (20, 1), (22, 1))
    assert counted.groups_seen == 3

    response = superuser.get(reverse(OVERVIEW))
    chart = charts(response)["failures"]
    assert [series.label for series in chart.series] == [
        f"event: {normalise(timeout)}",
        f"message: {normalise(lookup)}",
        f"event: {normalise(unroutable)}",
    ]
    assert chart.series[0].url.endswith(f"?failure={fingerprint_of(timeout)}")
    assert "/failedmessage/" in chart.series[1].url
    assert "3 failure groups failed in the last 24 hours." in response.content.decode()


# --- the drawing ------------------------------------------------------------------------------


def test_the_svg_escapes_what_it_draws_and_titles_every_bar(window):
    chart = Chart(
        key="x",
        title="<b>Title</b>",
        description="A & B",
        hours=window.hours,
        series=(Series("<script>alert(1)</script>", at((0, 5), (23, 1)), 'ok" onload="x'),),
    )
    svg = str(chart.svg())
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    assert 'onload="x"' not in svg
    assert "&lt;b&gt;Title&lt;/b&gt;" in svg and "A &amp; B" in svg
    assert svg.count("<rect") == 2 and svg.count("<title") == 3
    assert 'role="img"' in svg and 'aria-labelledby="idempotency-chart-x-title' in svg


def test_lines_break_where_an_hour_has_no_value_and_durations_use_a_log_scale(window):
    seconds = [None] * HOURS
    seconds[1], seconds[2], seconds[5] = 0.04, 2.0, 900.0
    chart = Chart(
        key="lag",
        title="Lag",
        description="",
        hours=window.hours,
        series=(Series("slowest", tuple(seconds), "max"),),
        kind="lines",
        seconds=True,
    )
    svg = str(chart.svg())
    path = re.search(r'<path class="idempotency-line[^"]*" d="([^"]+)"', svg).group(1)
    assert path.count("M") == 2 and path.count("L") == 1  # hours 1-2 joined, 5 alone
    assert svg.count("<circle") == 3
    for tick in ("10 ms", "100 ms", "1 s", "10 s", "1 min", "10 min", "1 h"):
        assert f">{tick}</text>" in svg, tick
    assert format_seconds(0.04) == "40 ms" and format_seconds(5400) == "1.5 h"


def test_the_records_index_exists(window):
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, IdempotencyRecord._meta.db_table)
    index = found[RECORD_CREATED_INDEX.name]
    assert index["index"] and index["columns"][0] == "created_at"


def test_the_hour_buckets_follow_the_database_clock(window):
    assert len(window.hours) == HOURS
    assert window.hours[-1] <= window.now < window.hours[-1] + overview.HOUR
    assert window.slot(window.hours[0] - timedelta(seconds=1)) is None
    assert window.slot(window.hours[23].isoformat()) == 23
    assert window.end(23) == window.now
