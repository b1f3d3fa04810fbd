"""End to end in headless Chromium: log in, filter stuck keys, release one, check the rest;
filter failed outbox events and retry one.

Uses Debian's ``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them); nothing
is downloaded. Screenshots go to ``artifacts/browser/`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_idempotency.models import IdempotencyRecord, OutboxEvent
from tests.backends import backends_required
from tests.factories import IdempotencyRecordFactory, OutboxEventFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "browser"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)


@pytest.fixture
def browser(tmp_path):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = "apt-get install chromium chromium-driver"
        if backends_required():
            pytest.fail(f"Chromium is required: {message}")
        pytest.skip(f"Chromium is not installed: {message}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(driver, css: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, 30).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def shown_keys(driver) -> set[str]:
    from selenium.webdriver.common.by import By

    return {
        cell.text
        for cell in driver.find_elements(By.CSS_SELECTOR, "#result_list .field-key_display")
    }


def run_action(browser, row_xpath: str, action: str) -> None:
    """Tick the row ``row_xpath`` finds, choose ``action`` and press Go."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    row = browser.find_element(By.XPATH, row_xpath)
    row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value(action)
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()


def log_in(browser, live_server, page: str) -> None:
    """Log in as the on-call superuser and land on ``page``, navigation sidebar folded."""
    from selenium.webdriver.common.by import By

    User.objects.create_superuser("oncall", "oncall@example.com", "correct horse battery")
    browser.get(f"{live_server.url}/admin/login/?next={page}")
    browser.find_element(By.NAME, "username").send_keys("oncall")
    browser.find_element(By.NAME, "password").send_keys("correct horse battery")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait_for(browser, "#idempotency-health")
    browser.find_element(By.ID, "toggle-nav-sidebar").click()  # more room for the columns


def test_log_in_filter_stuck_keys_and_release_one(browser, live_server):
    from selenium.webdriver.common.by import By

    for key in ("pay-1001", "pay-1002", "pay-1003"):
        IdempotencyRecordFactory(key=key, stuck=True, path="/api/v1/payments/")
    IdempotencyRecordFactory(key="pay-2001", running=True, path="/api/v1/payments/")
    IdempotencyRecordFactory.create_batch(3, path="/api/v1/payments/")
    IdempotencyRecordFactory(
        key="pay-0999",
        path="/api/v1/payments/",
        response_headers=[["Content-Type", "application/json"], ["Location", "/payments/77"]],
        response_body=b'{"id":77,"amount":"125.00","currency":"EUR","status":"captured"}',
    )

    log_in(browser, live_server, "/admin/django_idempotency/idempotencyrecord/")
    browser.save_screenshot(str(ARTIFACTS / "1-changelist.png"))
    assert "3" in browser.find_element(By.CSS_SELECTOR, "#idempotency-health li.alert").text

    browser.find_element(By.LINK_TEXT, "Stuck (lease expired)").click()
    wait_for(browser, "#changelist-filter li.selected a[href='?stuck=yes']")
    assert shown_keys(browser) == {"pay-1001", "pay-1002", "pay-1003"}
    browser.save_screenshot(str(ARTIFACTS / "2-stuck-filter.png"))

    run_action(browser, "//tr[th[normalize-space()='pay-1002']]", "release_keys")
    message = wait_for(browser, "ul.messagelist li.success")
    assert message.text == "Released 1 idempotency key."
    assert shown_keys(browser) == {"pay-1001", "pay-1003"}
    browser.save_screenshot(str(ARTIFACTS / "3-released.png"))

    remaining = set(IdempotencyRecord.objects.values_list("key", flat=True))
    assert "pay-1002" not in remaining
    assert {"pay-1001", "pay-1003", "pay-2001"} <= remaining
    assert len(remaining) == 7

    # The rest of the tour, for the screenshots in docs/operations-admin.md.
    browser.get(f"{live_server.url}/admin/django_idempotency/idempotencyrecord/?q=pay-0999")
    browser.find_element(By.LINK_TEXT, "pay-0999").click()
    wait_for(browser, "fieldset")
    browser.set_window_size(1400, 2000)
    browser.save_screenshot(str(ARTIFACTS / "4-detail.png"))
    browser.set_window_size(1400, 1000)
    browser.get(
        f"{live_server.url}/admin/django_idempotency/idempotencyrecord/?status__exact=PROCESSING"
    )
    wait_for(browser, "#result_list")
    run_action(browser, "//tr[th[normalize-space()='pay-2001']]", "force_release_keys")
    wait_for(browser, "ul.idempotency-confirm-list")
    browser.save_screenshot(str(ARTIFACTS / "5-force-release.png"))
    assert IdempotencyRecord.objects.filter(key="pay-2001").exists()


def test_filter_failed_outbox_events_and_retry_one(browser, live_server):
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

    log_in(browser, live_server, "/admin/django_idempotency/outboxevent/")
    assert "2" in browser.find_element(By.CSS_SELECTOR, "#idempotency-health li.alert").text
    browser.find_element(By.LINK_TEXT, "Failed (dead, or pending a retry)").click()
    wait_for(browser, "#changelist-filter li.selected a[href='?failed=yes']")
    assert shown_keys(browser) == {"order-1041", "order-1042", "order-1043"}
    browser.save_screenshot(str(ARTIFACTS / "6-outbox-failed.png"))

    run_action(browser, "//tr[td[normalize-space()='order-1041']]", "retry_events")
    message = wait_for(browser, "ul.messagelist li.success")
    assert message.text == "Queued 1 failed event to be sent again."
    retried = OutboxEvent.objects.get(pk=dead[0].pk)
    assert (retried.status, retried.attempts) == ("PENDING", 0)
    assert OutboxEvent.objects.get(pk=dead[1].pk).status == "DEAD"

    browser.get(f"{live_server.url}/admin/django_idempotency/outboxevent/{dead[1].pk}/change/")
    wait_for(browser, "fieldset")
    browser.set_window_size(1400, 1500)
    browser.save_screenshot(str(ARTIFACTS / "7-outbox-detail.png"))
