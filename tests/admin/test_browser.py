"""End to end in headless Chromium, at a laptop's 1280 px: log in, filter stuck keys, release
one from the list and one from its own page, check the rest; filter failed outbox events and
retry one; requeue a failure group that changes while its confirmation page is open; draw a
day of traffic on the overview page, in the light and the dark theme. Every changelist, change
page, failure groups page and the overview are checked for columns cut off on the right.

The screenshots are those of docs/operations-admin.md: they go to ``artifacts/browser/``
(git-ignored) under the names docs/img uses; look at them, then
``cp artifacts/browser/admin-*.png docs/img/`` when the pages changed.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from django_idempotency.core.failures import fingerprint_of
from django_idempotency.models import IdempotencyRecord, OutboxEvent
from tests.support.browser_support import (
    LAPTOP_WIDTH,
    chromium,
    clipped,
    save_screenshot,
    set_width,
    wait_for,
)
from tests.support.factories import IdempotencyRecordFactory, OutboxEventFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PAYMENTS = "/api/v1/payments/"


@pytest.fixture
def browser(tmp_path: Any) -> Iterator[Any]:
    for driver in chromium(tmp_path, width=LAPTOP_WIDTH, height=900):
        set_width(driver, LAPTOP_WIDTH)
        yield driver


def screenshot(browser: Any, name: str, height: int | None = None) -> None:
    """Save the page as docs/img/<name>.png shows it; ``height`` to take in a long page."""
    size = browser.get_window_size()
    if height:
        browser.set_window_size(size["width"], height)
    save_screenshot(browser, name)
    if height:
        browser.set_window_size(size["width"], size["height"])


def shown_keys(driver: Any) -> set[str]:
    from selenium.webdriver.common.by import By

    return {
        cell.text
        for cell in driver.find_elements(By.CSS_SELECTOR, "#result_list .field-key_display")
    }


def run_action(browser: Any, row_xpath: str, action: str) -> None:
    """Tick the row ``row_xpath`` finds, choose ``action`` and press Go."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    row = browser.find_element(By.XPATH, row_xpath)
    row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value(action)
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()


def log_in(browser: Any, live_server: Any, page: str) -> None:
    """Log in as the on-call superuser and land on ``page``, the navigation sidebar open as
    Django shows it by default."""
    from selenium.webdriver.common.by import By

    User.objects.create_superuser("oncall", "oncall@example.com", "correct horse battery")
    browser.get(f"{live_server.url}/admin/login/?next={page}")
    browser.find_element(By.NAME, "username").send_keys("oncall")
    browser.find_element(By.NAME, "password").send_keys("correct horse battery")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait_for(browser, "#content")


def fold_navigation(browser: Any) -> None:
    """Fold the navigation sidebar (Django remembers it across pages): the pages are checked
    with it open first, the screenshots are taken with the room it leaves."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "toggle-nav-sidebar").click()


def scope_lines(browser: Any) -> set[int]:
    """How many lines each scope cell of the list takes."""
    lines: list[int] = browser.execute_script(
        "return [...document.querySelectorAll('#result_list td.field-scope_display')].map("
        "cell => { const range = document.createRange(); range.selectNodeContents(cell);"
        " return new Set([...range.getClientRects()].map(rect => Math.round(rect.top))).size; })"
    )
    return set(lines)


def assert_nothing_cut_off(browser: Any, what: str) -> None:
    """Every column of a changelist and every field of a change page lies within the page."""
    cut = clipped(browser)
    if cut:
        save_screenshot(browser, f"cut-off-{what.replace(' ', '-')}")
    assert cut == [], f"cut off on the right of {what} at {LAPTOP_WIDTH} px"


def test_records_release_stuck_keys_from_the_list_and_the_page(browser, live_server):
    from selenium.webdriver.common.by import By

    for key in ("pay-1001", "pay-1002", "pay-1003"):
        IdempotencyRecordFactory(key=key, stuck=True, path=PAYMENTS)
    IdempotencyRecordFactory(key="pay-2001", running=True, path=PAYMENTS, scope="user:17")
    for _ in range(3):
        IdempotencyRecordFactory(
            key=str(uuid.uuid4()),
            scope=f"user:{uuid.uuid4().int % 10_000}",
            path=f"{PAYMENTS}{uuid.uuid4()}/",
            method="PATCH",
            response_status=200,
        )
    IdempotencyRecordFactory(
        key="pay-0999",
        path=PAYMENTS,
        response_headers=[["Content-Type", "application/json"], ["Location", "/payments/77"]],
        response_body=b'{"id":77,"amount":"125.00","currency":"EUR","status":"captured"}',
    )

    IdempotencyRecordFactory(key="pay-3001", path=PAYMENTS, scope="anonymous")

    log_in(browser, live_server, "/admin/django_idempotency/idempotencyrecord/")
    wait_for(browser, "#idempotency-health")
    assert_nothing_cut_off(browser, "the records' changelist")
    assert scope_lines(browser) == {1}, "a scope wrapped inside a word"
    fold_navigation(browser)
    assert_nothing_cut_off(browser, "the records' changelist, navigation folded")
    screenshot(browser, "admin-changelist")
    assert "3" in browser.find_element(By.CSS_SELECTOR, "#idempotency-health li.alert").text

    browser.find_element(By.LINK_TEXT, "Stuck (lease expired)").click()
    wait_for(browser, "#changelist-filter li.selected a[href='?stuck=yes']")
    assert shown_keys(browser) == {"pay-1001", "pay-1002", "pay-1003"}

    run_action(browser, "//tr[th[normalize-space()='pay-1002']]", "release_keys")
    message = wait_for(browser, "ul.messagelist li.success")
    assert message.text == "Released 1 idempotency key."
    assert shown_keys(browser) == {"pay-1001", "pay-1003"}
    screenshot(browser, "admin-released")

    # A stuck key's own page says it is stuck, in words, and stored nothing; it releases it.
    browser.find_element(By.LINK_TEXT, "pay-1003").click()
    wait_for(browser, "fieldset")
    assert_nothing_cut_off(browser, "a stuck record's page")
    stuck = browser.find_element(By.CSS_SELECTOR, ".field-stuck .readonly").text
    assert stuck.startswith("Yes: the lease expired")
    assert not browser.find_elements(By.CSS_SELECTOR, ".field-stuck img")  # no tick icon
    stored = browser.find_element(By.CSS_SELECTOR, ".field-body_display .readonly").text
    assert stored.startswith("Nothing stored")
    assert "✓" not in browser.find_element(By.CSS_SELECTOR, "#content-main").text
    screenshot(browser, "admin-stuck-detail", height=1900)
    browser.find_element(By.CSS_SELECTOR, "button[value=release_keys]").click()
    message = wait_for(browser, "ul.messagelist li.success")
    assert message.text == "Released 1 idempotency key."

    remaining = set(IdempotencyRecord.objects.values_list("key", flat=True))
    assert {"pay-1002", "pay-1003"}.isdisjoint(remaining)
    assert {"pay-1001", "pay-2001", "pay-0999", "pay-3001"} <= remaining
    assert len(remaining) == 7

    # A completed record's page, as docs/operations-admin.md shows it.
    browser.get(f"{live_server.url}/admin/django_idempotency/idempotencyrecord/?q=pay-0999")
    browser.find_element(By.LINK_TEXT, "pay-0999").click()
    wait_for(browser, "fieldset")
    assert_nothing_cut_off(browser, "a completed record's page")
    screenshot(browser, "admin-detail", height=2000)

    # A running lease: its page offers the force release, which asks first.
    browser.get(f"{live_server.url}/admin/django_idempotency/idempotencyrecord/?q=pay-2001")
    browser.find_element(By.LINK_TEXT, "pay-2001").click()
    wait_for(browser, "fieldset")
    browser.find_element(By.CSS_SELECTOR, "button[value=force_release_keys]").click()
    wait_for(browser, "ul.idempotency-confirm-list")
    assert_nothing_cut_off(browser, "the force release confirmation")
    screenshot(browser, "admin-force-release")
    assert IdempotencyRecord.objects.filter(key="pay-2001").exists()


def test_outbox_filter_failed_events_and_retry_one(browser, live_server):
    from selenium.webdriver.common.by import By

    unroutable = "PublishError: unroutable: no queue bound for 'refunds.issued'"
    dead = [
        OutboxEventFactory(
            topic="refunds.issued",
            key=f"order-{n}",
            dead=True,
            last_error=unroutable,
            payload={"refund_id": n - 1000, "order_id": n, "amount": "25.00", "currency": "EUR"},
            headers={"tenant": "acme"},
            traceparent=f"00-4bf92f3577b34da6a3ce929d0e0e{n}-00f067aa0ba902b7-01",
        )
        for n in (1041, 1042)
    ]
    OutboxEventFactory(
        topic="invoices.sent",
        key="order-1043",
        failing=True,
        last_error="BrokerUnavailable: AMQP broker unreachable: ConnectionRefusedError(111)",
    )
    OutboxEventFactory.create_batch(4, published=True, topic="orders.paid")
    OutboxEventFactory(topic="orders.paid", key="order-1044")
    # The broker refuses this route: the error column names it a configuration error.
    OutboxEventFactory(topic="orders.paid", key="order-1045", misconfigured=True)

    log_in(browser, live_server, "/admin/django_idempotency/outboxevent/")
    wait_for(browser, "#idempotency-health")
    assert_nothing_cut_off(browser, "the outbox changelist")
    fold_navigation(browser)
    assert_nothing_cut_off(browser, "the outbox changelist, navigation folded")
    assert "2" in browser.find_element(By.CSS_SELECTOR, "#idempotency-health li.alert").text
    browser.find_element(By.LINK_TEXT, "Failed (dead, or pending a retry)").click()
    wait_for(browser, "#changelist-filter li.selected a[href='?failed=yes']")
    assert shown_keys(browser) == {"order-1041", "order-1042", "order-1043", "order-1045"}
    assert_nothing_cut_off(browser, "the failed outbox events")
    screenshot(browser, "admin-outbox")

    run_action(browser, "//tr[td[normalize-space()='order-1041']]", "retry_events")
    message = wait_for(browser, "ul.messagelist li.success")
    assert message.text == "Queued 1 failed event to be sent again."
    retried = OutboxEvent.objects.get(pk=dead[0].pk)
    assert (retried.status, retried.attempts) == ("PENDING", 0)
    assert OutboxEvent.objects.get(pk=dead[1].pk).status == "DEAD"

    browser.get(f"{live_server.url}/admin/django_idempotency/outboxevent/{dead[1].pk}/change/")
    wait_for(browser, "fieldset")
    assert_nothing_cut_off(browser, "an outbox event's page")
    assert "Transaction id" not in browser.find_element(By.CSS_SELECTOR, "#content-main").text
    screenshot(browser, "admin-outbox-detail", height=1600)


def webhook_timeout() -> tuple[str, str]:
    """The error and the traceback the relay stores when a real webhook times out: a socket
    that accepts connections (the kernel does) and never answers."""
    from django_idempotency.core.failures import describe, failure_traceback
    from django_idempotency.exceptions import PublishError
    from django_idempotency.publishers import OutboxMessage
    from django_idempotency.publishers.webhook import WebhookPublisher

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        url = f"http://127.0.0.1:{port}/hooks/{'9f' * 12}?token=XYZ"
        publisher = WebhookPublisher(url=url, secret="whsec_czNjcmV0", timeout=0.3)
        message = OutboxMessage.from_event(OutboxEventFactory.build(topic="partners.invoice"))
        try:
            publisher.publish(message)
        except PublishError as exc:
            return describe(exc), failure_traceback(exc)
        finally:
            publisher.close()
    raise AssertionError("the webhook did not time out")


def failed_event(error: str, topic: str, minutes: float, **fields: Any) -> OutboxEvent:
    """An event the relay failed ``minutes`` ago with ``error``, grouped as the relay does."""
    now = timezone.now()
    return OutboxEventFactory(
        topic=topic,
        last_error=error,
        failure_fingerprint=fingerprint_of(error),
        failing_since=now - timedelta(minutes=minutes),
        last_failed_at=now - timedelta(minutes=minutes / 4),
        payload={"order_id": int(minutes * 10), "amount": "25.00", "currency": "EUR"},
        **fields,
    )


def test_failure_groups_requeue_a_group_that_changed_meanwhile(browser, live_server):
    from selenium.webdriver.common.by import By

    timeout, traceback = webhook_timeout()
    assert "XYZ" not in traceback and "9f9f9f" not in traceback  # redacted by the publisher
    outage = [
        failed_event(timeout, "partners.invoice", minutes, key=f"inv-{n}", **state)
        for n, (minutes, state) in enumerate(
            [
                (95, {"dead": True}),
                (90, {"dead": True}),
                (70, {"dead": True}),
                (40, {"dead": True}),
                (12, {"failing": True}),
                (8, {"failing": True}),
            ]
        )
    ]
    for event in outage:
        OutboxEvent.objects.filter(pk=event.pk).update(
            last_error=timeout, failure_traceback=traceback
        )
    for order in (1041, 1042):
        failed_event(
            "PublishError: unroutable: no queue bound for 'refunds.issued'",
            "refunds.issued",
            minutes=order - 1000,
            key=f"order-{order}",
            dead=True,
        )
    OutboxEventFactory.create_batch(3, published=True)
    # A consumer failing for one reason, recorded as consume_once records it.
    from django_idempotency.inbox import consume_once

    for n in (7, 8, 9):
        try:
            with consume_once("ledger.post", f"msg-{n}"):
                raise LookupError(f"no ledger account for customer {n * 1111}")
        except LookupError:
            pass

    log_in(browser, live_server, "/admin/django_idempotency/outboxevent/")
    wait_for(browser, "#idempotency-health")
    browser.find_element(By.CSS_SELECTOR, "a.idempotency-failure-groups-link").click()
    wait_for(browser, "#failure-groups")
    assert_nothing_cut_off(browser, "the failure groups page")
    fold_navigation(browser)
    assert_nothing_cut_off(browser, "the failure groups page, navigation folded")
    consumers = browser.find_element(By.CSS_SELECTOR, "#message-failure-groups tr.failure-group")
    assert consumers.find_element(By.CSS_SELECTOR, "code").text == (
        "LookupError: no ledger account for customer <n>"
    )
    assert consumers.find_element(By.CSS_SELECTOR, ".field-events").text == "3"
    rows = browser.find_elements(By.CSS_SELECTOR, "#failure-groups tr.failure-group")
    signatures = [row.find_element(By.CSS_SELECTOR, "code").text for row in rows]
    assert signatures == [
        "PublishError: webhook http://<n>.<n>.<n>.<n>:<n>/hooks/***?token=*** failed: ReadTimeout",
        "PublishError: unroutable: no queue bound for 'refunds.issued'",
    ]
    webhook = rows[0]
    assert webhook.find_element(By.CSS_SELECTOR, ".field-events").text == ("6\n4 dead, 2 retrying")
    newest = browser.find_elements(By.CSS_SELECTOR, "#failure-groups tr.failure-group-traceback")
    newest[0].find_element(By.CSS_SELECTOR, "details summary").click()
    shown = newest[0].find_element(By.CSS_SELECTOR, "details pre")
    # A tall traceback opens at its end, where the exception is; its first frames are above.
    opens_at_end = browser.execute_script(
        """const box = arguments[0].parentElement, pre = arguments[0].getBoundingClientRect();
        const shown = box.getBoundingClientRect();
        return pre.top < shown.top && Math.abs(pre.bottom - shown.bottom) < 2;""",
        shown,
    )
    assert opens_at_end
    assert shown.is_displayed() and "httpx.ReadTimeout (message not stored)" in shown.text
    assert_nothing_cut_off(browser, "the failure groups page, a traceback open")
    screenshot(browser, "admin-failure-groups", height=1350)

    # The group's events, from its row.
    webhook.find_element(By.LINK_TEXT, "Show events").click()
    wait_for(browser, "#changelist-filter")
    assert shown_keys(browser) == {f"inv-{n}" for n in range(6)}
    browser.back()

    wait_for(browser, "#failure-groups")
    browser.find_element(By.CSS_SELECTOR, "tr.failure-group a.idempotency-requeue").click()
    count = wait_for(browser, ".idempotency-group-count")
    assert count.text == "6 failed events will be sent again now (4 dead, 2 waiting for a retry)."
    assert_nothing_cut_off(browser, "the requeue confirmation")
    screenshot(browser, "admin-failure-group-requeue")

    # While the page is open, a relay publishes one of the retrying events.
    OutboxEvent.objects.filter(pk=outage[5].pk).update(
        status="PUBLISHED", published_at=timezone.now(), failure_fingerprint=None
    )
    browser.find_element(By.CSS_SELECTOR, "#content form input[type=submit]").click()
    success = wait_for(browser, "ul.messagelist li.success")
    assert success.text == "Requeued 5 events of the failure group."
    warning = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.warning").text
    assert warning.startswith("The group changed since the page was opened: 1 of the 6 events")
    screenshot(browser, "admin-failure-group-requeued")
    statuses = dict(
        OutboxEvent.objects.filter(pk__in=[e.pk for e in outage]).values_list("key", "status")
    )
    assert statuses == {**{f"inv-{n}": "PENDING" for n in range(5)}, "inv-5": "PUBLISHED"}
    remaining = browser.find_elements(By.CSS_SELECTOR, "#failure-groups tr.failure-group code")
    assert [code.text for code in remaining] == [signatures[1]]


def a_day_of_traffic() -> None:
    """24 hours of a payments service, hour by hour: requests (some refused, a few 409s, a
    stuck key, keys taken over), events published a fraction of a second after their commit
    until a broker outage three hours ago left a backlog, events going dead, two failure
    groups and a consumer failing."""
    import math

    from django_idempotency.db.querysets import OutboxStatus
    from django_idempotency.models import FailedMessage
    from django_idempotency.operations import overview

    window = overview.window()
    records, events = [], []
    for index, hour in enumerate(window.hours):
        traffic = int(30 + 18 * math.sin((index - 6) / 24 * 2 * math.pi))
        for n in range(traffic):
            moment = hour + timedelta(seconds=n * 3599 / traffic)
            if moment > window.now:
                break
            fields: dict[str, Any] = {"created_at": moment, "key": str(uuid.uuid4())}
            if n % 9 == 0:
                fields["response_status"] = 422
            if index in (14, 15) and n % 7 == 3:  # a double-submitting client
                fields["response_status"] = 409
            if index in (8, 9) and n % 5 == 1:  # a slow database: leases ran out
                fields["attempts"] = 2
            records.append(IdempotencyRecordFactory.build(**fields))
            outage = index >= len(window.hours) - 3
            lag = timedelta(milliseconds=40 + (n % 10) * 25 + (4000 if index in (8, 9) else 0))
            published = not outage and moment + lag <= window.now
            events.append(
                OutboxEventFactory.build(
                    created_at=moment,
                    status=OutboxStatus.PUBLISHED if published else OutboxStatus.PENDING,
                    published_at=moment + lag if published else None,
                    key=f"order-{index}-{n}",
                )
            )
    IdempotencyRecord.objects.bulk_create(records)
    OutboxEvent.objects.bulk_create(events)
    IdempotencyRecordFactory(created_at=window.hours[-2], stuck=True)
    IdempotencyRecordFactory(created_at=window.hours[-1], running=True)
    unroutable = "PublishError: unroutable: no queue bound for 'refunds.issued'"
    unreachable = "BrokerUnavailable: AMQP broker unreachable: ConnectionRefusedError(111)"
    for index, error, count in ((4, unroutable, 3), (11, unroutable, 5), (21, unreachable, 6)):
        OutboxEvent.objects.bulk_create(
            OutboxEventFactory.build(
                topic="refunds.issued",
                created_at=window.hours[index] - timedelta(minutes=30),
                status=OutboxStatus.DEAD if index < 20 else OutboxStatus.PENDING,
                attempts=10 if index < 20 else 3,
                last_error=error,
                failure_fingerprint=fingerprint_of(error),
                failing_since=window.hours[index] - timedelta(minutes=20),
                last_failed_at=window.hours[index] + timedelta(minutes=10),
            )
            for _ in range(count)
        )
    lookup = "LookupError: no ledger account for customer 4242"
    FailedMessage.objects.bulk_create(
        FailedMessage(
            consumer="ledger.post",
            message_id=f"msg-{n}",
            last_error=lookup,
            failure_fingerprint=fingerprint_of(lookup),
            failing_since=window.hours[16],
            last_failed_at=window.hours[16 + n % 4],
        )
        for n in range(8)
    )


def chart_boxes(browser: Any) -> dict[str, list[float]]:
    """Each chart's drawing: its width and height on the page, and its bars and points."""
    boxes: list[list[Any]] = browser.execute_script(
        "return [...document.querySelectorAll('svg.idempotency-chart-svg')].map(svg => {"
        " const box = svg.getBoundingClientRect();"
        " return [svg.id, box.width, box.height, svg.querySelectorAll('rect, circle').length]; })"
    )
    return {box[0]: box[1:] for box in boxes}


def test_overview_charts_are_drawn_in_the_light_and_the_dark_theme(browser, live_server):
    from selenium.webdriver.common.by import By

    from tests.support.browser_support import ARTIFACTS

    a_day_of_traffic()
    log_in(browser, live_server, "/admin/")
    assert_nothing_cut_off(browser, "the admin index")
    screenshot(browser, "admin-index")
    browser.find_element(By.CSS_SELECTOR, "#idempotency-overview-link th a").click()
    wait_for(browser, "svg.idempotency-chart-svg")
    assert_nothing_cut_off(browser, "the overview")
    fold_navigation(browser)
    assert_nothing_cut_off(browser, "the overview, navigation folded")
    boxes = chart_boxes(browser)
    assert set(boxes) == {
        f"idempotency-chart-{key}-svg"
        for key in ("outcomes", "conflicts", "backlog", "lag", "dead", "failures")
    }
    for name, (width, height, marks) in boxes.items():
        assert width > 400 and height > 150 and marks > 0, (name, width, height, marks)

    def colours() -> tuple[str, str]:
        return browser.execute_script(
            "const bar = document.querySelector('#idempotency-chart-outcomes-svg rect');"
            "const label = document.querySelector('#idempotency-chart-outcomes-svg text');"
            "return [getComputedStyle(bar).fill, getComputedStyle(label).fill];"
        )

    bar, label = colours()
    assert bar == "rgb(63, 154, 92)"  # the "succeeded" tone, not the default black
    screenshot(browser, "admin-overview", height=2100)
    print(f"overview screenshot: {ARTIFACTS / 'admin-overview.png'}")

    browser.execute_script("localStorage.setItem('theme', 'dark')")
    browser.refresh()
    wait_for(browser, "html[data-theme=dark] svg.idempotency-chart-svg")
    dark_bar, dark_label = colours()
    assert dark_bar == bar and dark_label != label  # the axes follow the theme
    assert dark_label == "rgb(208, 208, 208)"  # --body-quiet-color, legible on near-black
    screenshot(browser, "admin-overview-dark", height=2100)
    print(f"overview screenshot, dark: {ARTIFACTS / 'admin-overview-dark.png'}")
