"""drf-spectacular postprocessing hooks for the demo's schema (``SPECTACULAR_SETTINGS``): what
drf-spectacular cannot see in the views, so that a schema-driven tool (schemathesis, in
``tests/demo/test_schemathesis.py``) finds the schema true."""

from __future__ import annotations

from typing import Any

HTTP_METHODS = {"get", "put", "patch", "delete", "head", "options", "trace", "post"}


def document_not_found(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """Every operation on one object (a path with a parameter) answers 404 when there is no such
    object, with DRF's ``{"detail": ...}``; drf-spectacular leaves that answer out."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault(
        "NotFound",
        {
            "type": "object",
            "properties": {"detail": {"type": "string"}},
            "required": ["detail"],
        },
    )
    for path, item in result.get("paths", {}).items():
        if "{" not in path:
            continue
        for method, operation in item.items():
            if method in HTTP_METHODS:
                operation.setdefault("responses", {}).setdefault(
                    "404",
                    {
                        "description": "No such object.",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/NotFound"}
                            }
                        },
                    },
                )
    return result


#: OpenAPI links from a created payment to the operations on it.
PAYMENT_LINKS = {
    "GetPayment": "v1_payments_retrieve",
    "ChangePaymentStatus": "v1_payments_partial_update",
}


def link_payments(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """A created payment's ``transaction_id`` is what its own operations take: say so, so that
    clients and test tools can follow a POST with a GET or a PATCH of the same payment."""
    created = result.get("paths", {}).get("/api/v1/payments/", {}).get("post", {})
    response = created.get("responses", {}).get("201")
    if response is not None:
        response["links"] = {
            name: {
                "operationId": operation_id,
                "parameters": {"transaction_id": "$response.body#/transaction_id"},
            }
            for name, operation_id in PAYMENT_LINKS.items()
        }
    return result
