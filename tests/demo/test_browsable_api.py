"""The browsable API of the demo, in headless Chromium: its forms send the Idempotency-Key
header from the page's key field (``django_idempotency.drf.browsable``), so a payment made from the
HTML form happens once, and submitting it again with the same key replays it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.demo.conftest import DemoServer
from tests.support.browser_support import chromium, save_screenshot, wait_for

pytestmark = pytest.mark.browser

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
AMOUNT = "7.31"  # no other test pays this amount


@pytest.fixture
def browser(tmp_path: Any) -> Iterator[Any]:
    yield from chromium(tmp_path, width=1280, height=1400)


def pay_with_the_html_form(browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    form = browser.find_element(By.CSS_SELECTOR, "#post-object-form form")
    amount = form.find_element(By.NAME, "amount")
    amount.clear()
    amount.send_keys(AMOUNT)
    currency = form.find_element(By.NAME, "currency")
    currency.clear()
    currency.send_keys("USD")
    Select(form.find_element(By.NAME, "source_account")).select_by_visible_text("acc_5")
    Select(form.find_element(By.NAME, "destination_account")).select_by_visible_text("acc_3")
    form.find_element(By.CSS_SELECTOR, "button.btn-primary").click()


def answer_status(browser: Any, method: str, page: Any) -> str:
    """The status line of the answer to ``method``, once it has replaced ``page`` (an element
    of the page the request was sent from)."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30).until(expected_conditions.staleness_of(page))
    request = wait_for(browser, ".request-info pre b")
    assert request.text == method
    return str(wait_for(browser, ".response-info pre b").text)


def stored(server: DemoServer, key: str) -> str:
    """How many payments of AMOUNT exist, and the records of ``key``: from the server's
    database."""
    return server.django(
        "from demo_project.payments.models import Payment\n"
        "from django_idempotency.models import IdempotencyRecord\n"
        f"print(Payment.objects.filter(amount={AMOUNT!r}).count(),"
        f" list(IdempotencyRecord.objects.filter(key={key!r}).values_list('status', 'method')))"
    ).strip()


def test_the_html_form_pays_once_and_its_resubmission_replays(
    demo_server: DemoServer, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{demo_server.url}/api/v1/payments/")
    field = wait_for(browser, "#idempotency-key")
    key = field.get_attribute("value")
    assert UUID.fullmatch(key)
    # The field sits above the forms, outside every form, and has no name: never in a body.
    assert field.get_attribute("name") in (None, "")
    assert not browser.find_elements(By.CSS_SELECTOR, "form #idempotency-key")
    save_screenshot(browser, "browsable-api-form")

    pay_with_the_html_form(browser)
    assert answer_status(browser, "POST", field) == "HTTP 201 Created"
    new_key = wait_for(browser, "#idempotency-key").get_attribute("value")
    assert UUID.fullmatch(new_key) and new_key != key  # a new key for the next payment
    assert stored(demo_server, key) == "1 [('COMPLETED', 'POST')]"

    # The same payment sent again with the first key: the stored answer, nothing done twice.
    field = browser.find_element(By.ID, "idempotency-key")
    field.clear()
    field.send_keys(key)
    pay_with_the_html_form(browser)
    assert answer_status(browser, "POST", field) == "HTTP 201 Created"
    note = wait_for(browser, "#idempotency-key-note").text
    assert note.startswith("Replayed:") and key in note
    save_screenshot(browser, "browsable-api-replayed")
    assert stored(demo_server, key) == "1 [('COMPLETED', 'POST')]"


def test_the_raw_data_form_refunds_once(demo_server: DemoServer, browser: Any) -> None:
    """DRF sends its raw-data forms by AJAX itself: the header rides along with them too."""
    from selenium.webdriver.common.by import By

    payment = (
        demo_server.client()
        .pay(f"test-{AMOUNT}-refund", "1.00", source="acc_5", destination="acc_3")
        .body
    )
    browser.get(f"{demo_server.url}/api/v1/payments/{payment['transaction_id']}/")
    field = wait_for(browser, "#idempotency-key")
    key = field.get_attribute("value")
    content = browser.find_element(By.CSS_SELECTOR, "#put-generic-content-form textarea")
    content.clear()
    content.send_keys('{"status": "refunded"}')
    browser.find_element(
        By.CSS_SELECTOR, "#put-generic-content-form button[data-method=PATCH]"
    ).click()
    assert answer_status(browser, "PATCH", field) == "HTTP 200 OK"
    assert '"status": "refunded"' in browser.find_element(By.CSS_SELECTOR, ".response-info").text
    assert (
        demo_server.django(
            "from django_idempotency.models import IdempotencyRecord\n"
            f"print(list(IdempotencyRecord.objects.filter(key={key!r}).values_list('method')))"
        ).strip()
        == "[('PATCH',)]"
    )
