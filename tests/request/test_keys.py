import hashlib
import re

import pytest
from django.test import override_settings

from django_idempotency.exceptions import IdempotencyKeyInvalid
from django_idempotency.request.keys import parse_key, redact


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("abc", "abc"),
        ('"abc"', "abc"),
        ("  abc  ", "abc"),
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"with space inside"', "with space inside"),
        (r'"esc\"aped\\"', 'esc"aped\\'),
        ("k" * 255, "k" * 255),
    ],
)
def test_valid_keys(raw, key):
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    ["", '""', "k" * 256, '"' + "k" * 256 + '"', "a b", "a,b", '"a","b"', '"a" x', '"a', "é",
     "a\x00b", '"a\\nb"', '" padded "', "a\\b"],
)  # fmt: skip
def test_invalid_keys(raw):
    with pytest.raises(IdempotencyKeyInvalid):
        parse_key(raw)


def test_redaction_hides_the_key_but_correlates():
    assert redact("secret-key") == redact("secret-key")
    assert "secret" not in redact("secret-key")
    assert redact("a") != redact("b")
    assert re.fullmatch(r"hmac:[0-9a-f]{12}", redact("order-123"))


def test_a_guessed_key_cannot_be_confirmed_without_the_secret_key():
    """Hashing guesses (``order-1``, ``order-2``, ...) finds nothing: the hash is keyed."""
    redacted = redact("order-123")
    for digest in (hashlib.sha256, hashlib.sha1, hashlib.md5, hashlib.blake2b):
        assert digest(b"order-123").hexdigest()[:12] not in redacted
    with override_settings(SECRET_KEY="another-secret-key-entirely-for-this-test"):
        assert redact("order-123") != redacted  # rotating SECRET_KEY rotates it


@pytest.mark.parametrize("secret", ["a str secret " + "x" * 40, b"a bytes secret " + b"x" * 40])
def test_salted_digest_is_django_s_salted_hmac_under_the_secret_key_of_the_moment(secret):
    """Its key is derived once per secret, and the digest is the one ``salted_hmac`` gives:
    redacted keys and credentials' scopes stored before stay the same."""
    from django.utils.crypto import salted_hmac

    from django_idempotency.request.keys import salted_digest

    def expected(value: str) -> str:
        return salted_hmac("a salt", value, algorithm="sha256").hexdigest()

    with override_settings(SECRET_KEY=secret):
        assert salted_digest("a salt", "Token é") == expected("Token é")
        assert salted_digest("another salt", "Token é") != expected("Token é")
    assert salted_digest("a salt", "Token é") == expected("Token é")  # the project's own secret
