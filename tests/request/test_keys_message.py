"""The ``idempotency_key_invalid`` message says exactly what a key may be: each refused value
breaks a rule the message names, and the values it says are fine are accepted."""

from __future__ import annotations

import pytest

from django_idempotency.exceptions import IdempotencyKeyInvalid
from django_idempotency.request.keys import parse_key

MESSAGE = str(IdempotencyKeyInvalid().detail)


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("order 1", "without spaces"),
        ("order,1", "commas"),
        ('order"1', "double quotes"),
        ("order\\1", "backslashes"),
        ("caf\u00e9", "printable ASCII"),
        ("x" * 256, "1 to 255 characters"),
        ('" order-1"', "no space at either end"),
        ('"order\\x"', 'with \\" and \\\\ escaped'),
    ],
)
def test_a_printable_but_refused_key_breaks_a_rule_the_message_names(value, rule):
    with pytest.raises(IdempotencyKeyInvalid):
        parse_key(value)
    assert rule in MESSAGE


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("6c0f8a3e-1f7b-4b4e-9f4e-2f1d2c3b4a59", "6c0f8a3e-1f7b-4b4e-9f4e-2f1d2c3b4a59"),
        ('"order 1, retry"', "order 1, retry"),
        ('"say \\"hi\\" \\\\o/"', 'say "hi" \\o/'),
    ],
)
def test_what_the_message_allows_is_accepted(value, key):
    assert parse_key(value) == key
    assert "a UUID is fine" in MESSAGE
    assert "double-quoted string of printable ASCII" in MESSAGE
