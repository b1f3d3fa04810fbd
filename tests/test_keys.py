import pytest

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
