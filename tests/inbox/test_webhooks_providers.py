"""Each webhook provider accepts what its sender's own signing code makes, and refuses the rest
with a ``WebhookRejected``, never another exception; no database."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import stripe
from django.http import HttpRequest
from django.test import RequestFactory, override_settings
from hypothesis import given
from hypothesis import strategies as st
from standardwebhooks import Webhook

from django_idempotency.exceptions import (
    IdempotencyConfigurationError,
    WebhookIdInvalid,
    WebhookRejected,
    WebhookSignatureInvalid,
    WebhookTimestampStale,
)
from django_idempotency.inbox.webhooks import CustomProvider, GitHub, StandardWebhooks, Stripe
from django_idempotency.inbox.webhooks.providers import valid_event_id
from django_idempotency.publishers.webhook import new_secret

STRIPE_SECRET = "whsec_stripe_test_0f9e8d7c"
EVENT = json.dumps({"id": "evt_1Q", "object": "event", "type": "charge.succeeded"})


def post(body: bytes | str, **headers: str) -> HttpRequest:
    data = body.encode() if isinstance(body, str) else body
    return RequestFactory().post(
        "/hook/", data=data, content_type="application/json", headers=headers
    )


def body_of(request: HttpRequest) -> bytes:
    return request.body


# --- Stripe ---------------------------------------------------------------------------------------


def stripe_header(payload: str = EVENT, *, secret: str = STRIPE_SECRET, at: int | None = None):
    return stripe.WebhookSignature.generate_signature_header(payload, secret, timestamp=at)


def test_stripe_accepts_what_stripes_own_code_signs():
    request = post(EVENT, Stripe_Signature=stripe_header())
    delivery = Stripe(secret=STRIPE_SECRET).receive(request, body_of(request))
    assert (delivery.id, delivery.type) == ("evt_1Q", "charge.succeeded")
    assert delivery.payload["object"] == "event"
    # Stripe's own check agrees on the same request.
    stripe.WebhookSignature.verify_header(EVENT, request.headers["Stripe-Signature"], STRIPE_SECRET)


def test_stripe_accepts_any_v1_while_a_secret_is_rolled_and_either_secret_of_ours():
    old, new = stripe_header(secret="whsec_old"), stripe_header(secret=STRIPE_SECRET)
    t = old.split(",")[0]
    both = f"{t},{old.split(',')[1]},{new.split(',')[1]},v0=abc"
    request = post(EVENT, Stripe_Signature=both)
    assert Stripe(secret=STRIPE_SECRET).receive(request, request.body).id == "evt_1Q"
    rotated = post(EVENT, Stripe_Signature=stripe_header(secret="whsec_old"))
    assert Stripe(secret=["whsec_old", STRIPE_SECRET]).receive(rotated, rotated.body)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "t=1",
        "v1=" + "0" * 64,
        "garbage",
        "t=abc,v1=" + "0" * 64,
        "t=1,t=2,v1=" + "0" * 64,
        "x" * 5000,
    ],
)
def test_stripe_refuses_a_malformed_header_as_a_bad_signature(header):
    headers = {} if header is None else {"Stripe-Signature": header}
    request = post(EVENT, **{k.replace("-", "_"): v for k, v in headers.items()})
    with pytest.raises(WebhookSignatureInvalid):
        Stripe(secret=STRIPE_SECRET).receive(request, request.body)


def test_stripe_refuses_another_secret_a_changed_body_and_a_stale_timestamp():
    provider = Stripe(secret=STRIPE_SECRET)
    wrong = post(EVENT, Stripe_Signature=stripe_header(secret="whsec_other"))
    with pytest.raises(WebhookSignatureInvalid):
        provider.receive(wrong, wrong.body)
    changed = post(EVENT.replace("evt_1Q", "evt_2Q"), Stripe_Signature=stripe_header())
    with pytest.raises(WebhookSignatureInvalid):
        provider.receive(changed, changed.body)
    now = int(time.time())
    for at in (now - 301, now + 301):
        stale = post(EVENT, Stripe_Signature=stripe_header(at=at))
        with pytest.raises(WebhookTimestampStale):
            provider.receive(stale, stale.body)
    late = post(EVENT, Stripe_Signature=stripe_header(at=now - 250))
    assert provider.receive(late, late.body)
    with pytest.raises(WebhookTimestampStale):
        Stripe(secret=STRIPE_SECRET, tolerance=60).receive(late, late.body)


@given(header=st.text(max_size=300), payload=st.sampled_from([EVENT, "{}", "x"]))
def test_stripe_never_accepts_what_stripes_own_check_refuses(header: str, payload: str):
    request = post(payload, Stripe_Signature=header) if header.isprintable() else post(payload)
    received = request.headers.get("Stripe-Signature")
    try:
        Stripe(secret=STRIPE_SECRET).receive(request, request.body)
    except WebhookRejected:
        return
    stripe.WebhookSignature.verify_header(payload, received, STRIPE_SECRET, tolerance=300)


# --- GitHub ---------------------------------------------------------------------------------------

#: The example in GitHub's documentation ("Validating webhook deliveries").
GITHUB_DOC_SECRET = "It's a Secret to Everybody"
GITHUB_DOC_BODY = b"Hello, World!"
GITHUB_DOC_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"


def test_github_accepts_githubs_documented_example():
    request = post(
        GITHUB_DOC_BODY,
        X_Hub_Signature_256=GITHUB_DOC_SIGNATURE,
        X_GitHub_Delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958",
        X_GitHub_Event="issues",
    )
    delivery = GitHub(secret=GITHUB_DOC_SECRET).receive(request, request.body)
    assert (delivery.id, delivery.type, delivery.payload) == (
        "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "issues",
        None,  # not JSON
    )


@pytest.mark.parametrize(
    "signature",
    [
        GITHUB_DOC_SIGNATURE.upper(),
        GITHUB_DOC_SIGNATURE.replace("sha256=", "sha1="),
        GITHUB_DOC_SIGNATURE[:-1] + "0",
        "sha256=",
        GITHUB_DOC_SIGNATURE + "00",
    ],
)
def test_github_refuses_any_other_signature(signature):
    request = post(GITHUB_DOC_BODY, X_Hub_Signature_256=signature, X_GitHub_Delivery="d")
    with pytest.raises(WebhookSignatureInvalid):
        GitHub(secret=GITHUB_DOC_SECRET).receive(request, request.body)


def test_github_reads_the_delivery_id_only_once_the_signature_holds():
    unsigned = post(GITHUB_DOC_BODY, X_GitHub_Delivery="bad id with spaces")
    with pytest.raises(WebhookSignatureInvalid):
        GitHub(secret=GITHUB_DOC_SECRET).receive(unsigned, unsigned.body)
    signed = post(GITHUB_DOC_BODY, X_Hub_Signature_256=GITHUB_DOC_SIGNATURE)
    with pytest.raises(WebhookIdInvalid):
        GitHub(secret=GITHUB_DOC_SECRET).receive(signed, signed.body)


# --- Standard Webhooks ---------------------------------------------------------------------------

STANDARD_SECRET = new_secret()


def standard_request(body: bytes, msg_id: str = "msg_1", *, at: int | None = None, **extra: str):
    stamp = int(time.time()) if at is None else at
    signature = Webhook(STANDARD_SECRET).sign(
        msg_id, datetime.fromtimestamp(stamp, tz=UTC), body.decode()
    )
    headers = {"webhook_id": msg_id, "webhook_timestamp": str(stamp)}
    headers["webhook_signature"] = signature
    headers.update(extra)
    return post(body, **headers)


def test_standard_webhooks_accepts_what_the_library_signs():
    body = json.dumps({"type": "email.sent"}).encode()
    request = standard_request(body)
    delivery = StandardWebhooks(secret=STANDARD_SECRET).receive(request, request.body)
    assert (delivery.id, delivery.type) == ("msg_1", "email.sent")


def test_standard_webhooks_refusals():
    provider = StandardWebhooks(secret=STANDARD_SECRET)
    body = b'{"a": 1}'
    now = int(time.time())
    cases: list[tuple[HttpRequest, type[WebhookRejected]]] = [
        (post(body), WebhookSignatureInvalid),  # no headers at all
        (standard_request(body, webhook_signature="v1"), WebhookSignatureInvalid),  # ValueError
        (standard_request(body, webhook_signature="v1,abc"), WebhookSignatureInvalid),
        (standard_request(body, webhook_signature="v2,xx v1"), WebhookSignatureInvalid),
        (standard_request(body, webhook_timestamp="1e9"), WebhookSignatureInvalid),
        (standard_request(body, at=now - 301), WebhookTimestampStale),
        (standard_request(body, at=now + 400), WebhookTimestampStale),
        (standard_request(body, "msg with space"), WebhookIdInvalid),
    ]
    for request, error in cases:
        with pytest.raises(error):
            provider.receive(request, request.body)
    other = standard_request(body)
    with pytest.raises(WebhookSignatureInvalid):
        provider.receive(other, body + b" ")
    with pytest.raises(WebhookSignatureInvalid):
        StandardWebhooks(secret=new_secret()).receive(other, other.body)


def test_standard_webhooks_refuses_a_body_that_is_not_utf8_without_raising_anything_else():
    request = post(b"\xff\xfe", webhook_id="m", webhook_timestamp=str(int(time.time())),
                   webhook_signature="v1," + base64.b64encode(b"x" * 32).decode())  # fmt: skip
    with pytest.raises(WebhookSignatureInvalid):
        StandardWebhooks(secret=STANDARD_SECRET).receive(request, request.body)


def test_standard_webhooks_tolerance_and_rotation():
    body = b"{}"
    late = standard_request(body, at=int(time.time()) - 120)
    with pytest.raises(WebhookTimestampStale):
        StandardWebhooks(secret=STANDARD_SECRET, tolerance=60).receive(late, late.body)
    assert StandardWebhooks(secret=[new_secret(), STANDARD_SECRET]).receive(late, late.body)
    with pytest.raises(IdempotencyConfigurationError, match="five minutes"):
        StandardWebhooks(secret=STANDARD_SECRET, tolerance=600)
    with pytest.raises(IdempotencyConfigurationError, match="whsec_"):
        StandardWebhooks(secret="not a standard secret")


# --- secrets, custom providers, ids --------------------------------------------------------------


def test_an_empty_secret_is_refused_when_the_provider_is_made():
    for provider in (Stripe, GitHub, StandardWebhooks):
        with pytest.raises(IdempotencyConfigurationError, match="secret is empty"):
            provider(secret="")
        with pytest.raises(IdempotencyConfigurationError, match="secret is empty"):
            provider(secret=[])


@override_settings(STRIPE_TEST_SECRET="whsec_from_settings_1")
def test_a_callable_secret_is_read_on_every_delivery():
    from django.conf import settings

    provider = Stripe(secret=lambda: settings.STRIPE_TEST_SECRET)
    first = post(EVENT, Stripe_Signature=stripe_header(secret="whsec_from_settings_1"))
    assert provider.receive(first, first.body).id == "evt_1Q"
    with override_settings(STRIPE_TEST_SECRET="whsec_from_settings_2"):
        with pytest.raises(WebhookSignatureInvalid):
            provider.receive(first, first.body)
        second = post(EVENT, Stripe_Signature=stripe_header(secret="whsec_from_settings_2"))
        assert provider.receive(second, second.body)
    with override_settings(STRIPE_TEST_SECRET=""), pytest.raises(IdempotencyConfigurationError):
        provider.receive(first, first.body)


def test_a_custom_verifier_that_says_no_or_raises_refuses_the_delivery():
    def event_id(request: HttpRequest, body: bytes) -> str:
        return request.headers["X-Id"]

    def raises(request: HttpRequest, body: bytes) -> Any:
        raise ValueError("cannot parse the signature")

    request = post(b"{}", X_Id="e-1")
    for verify in (lambda r, b: False, lambda r, b: None, raises):
        with pytest.raises(WebhookSignatureInvalid):
            CustomProvider(verify=verify, event_id=event_id).receive(request, request.body)
    ok = CustomProvider(verify=lambda r, b: True, event_id=event_id, event_type=lambda r, b: "t")
    delivery = ok.receive(request, request.body)
    assert (delivery.id, delivery.type, delivery.payload) == ("e-1", "t", {})
    with pytest.raises(WebhookIdInvalid):
        ok.receive(post(b"{}"), b"{}")  # event_id raises KeyError: no X-Id


def test_a_custom_verifier_may_answer_its_own_refusal():
    class Banned(WebhookRejected):
        status_code = 403
        default_code = "webhook_sender_banned"

    def verify(request: HttpRequest, body: bytes) -> bool:
        raise Banned()

    provider = CustomProvider(verify=verify, event_id=lambda r, b: "x")
    with pytest.raises(Banned):
        provider.receive(post(b"{}"), b"{}")


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("evt_1", True),
        ("72d3162e-cc78-11e3-81ab-4c9367dc0958", True),
        ("x" * 255, True),
        ("x" * 256, False),
        ("", False),
        ("a b", False),
        ("caf\xe9", False),
        ("line\n", False),
        (42, False),
        (None, False),
    ],
)
def test_event_ids_are_what_the_inbox_holds(value: object, valid: bool):
    if valid:
        assert valid_event_id(value) == value
    else:
        with pytest.raises(WebhookIdInvalid):
            valid_event_id(value)


def test_github_signature_is_hmac_sha256_of_the_body():
    """The scheme the GitHub provider checks, computed as GitHub documents it."""
    digest = hmac.new(GITHUB_DOC_SECRET.encode(), GITHUB_DOC_BODY, hashlib.sha256).hexdigest()
    assert f"sha256={digest}" == GITHUB_DOC_SIGNATURE
