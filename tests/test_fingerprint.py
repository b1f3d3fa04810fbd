from __future__ import annotations

from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import RequestFactory

from django_idempotency.request.fingerprint import (
    canonical_path,
    recorded_path,
    request_fingerprint,
)

factory = RequestFactory()


def json_fp(body: bytes, path: str = "/p/") -> str:
    return request_fingerprint(factory.post(path, body, content_type="application/json"))


def test_json_formatting_and_key_order_do_not_matter():
    assert json_fp(b'{"a": 1, "b": [1, 2]}') == json_fp(b'{\n "b":[1,2],"a":1}')
    assert json_fp(b'{"a": 1}') != json_fp(b'{"a": 2}')
    assert json_fp(b'{"a": 1}') != json_fp(b'{"a": 1}', path="/q/")


def test_method_matters():
    post = factory.post("/p/", b"{}", content_type="application/json")
    patch = factory.patch("/p/", b"{}", content_type="application/json")
    assert request_fingerprint(post) != request_fingerprint(patch)


def test_query_parameters_are_sorted():
    assert canonical_path(factory.get("/p/?b=2&a=1&a=0")) == "/p/?a=0&a=1&b=2"
    assert json_fp(b"{}", "/p/?b=2&a=1") == json_fp(b"{}", "/p/?a=1&b=2")


def test_hostile_json_falls_back_to_raw_bytes():
    nested = b"[" * 100_000 + b"]" * 100_000
    assert json_fp(nested) == json_fp(nested)
    assert json_fp(b'{"a": ') != json_fp(b'{"a":')  # not JSON: bytes count
    assert json_fp(b"\xff\xfe not utf-8") != json_fp(b"\xff\xfe not utf-8!")


def test_form_fields_are_sorted():
    first = factory.post("/p/", "b=2&a=1", content_type="application/x-www-form-urlencoded")
    second = factory.post("/p/", "a=1&b=2", content_type="application/x-www-form-urlencoded")
    assert request_fingerprint(first) == request_fingerprint(second)


def test_multipart_hashes_file_contents_and_leaves_them_readable():
    def upload(content: bytes):
        return factory.post("/p/", {"name": "x", "doc": SimpleUploadedFile("d.txt", content)})

    request = upload(b"hello")
    fingerprint = request_fingerprint(request)
    assert request.FILES["doc"].read() == b"hello"  # rewound for the view
    assert fingerprint == request_fingerprint(upload(b"hello"))
    assert fingerprint != request_fingerprint(upload(b"hellO"))


def test_multipart_patch_is_parsed_for_the_view():
    request = factory.generic(
        "PATCH", "/p/", _multipart({"name": "x"}, ("doc", "d.bin", b"data")),
        content_type="multipart/form-data; boundary=BoUnDaRy",
    )  # fmt: skip
    request_fingerprint(request)
    assert request.POST["name"] == "x"
    assert request.FILES["doc"].read() == b"data"


def _multipart(fields: dict[str, str], file: tuple[str, str, bytes]) -> bytes:
    lines = []
    for name, value in fields.items():
        lines += [b"--BoUnDaRy", f'Content-Disposition: form-data; name="{name}"'.encode(), b"",
                  value.encode()]  # fmt: skip
    field, filename, content = file
    lines += [
        b"--BoUnDaRy",
        f'Content-Disposition: form-data; name="{field}"; filename="{filename}"'.encode(),
        b"Content-Type: application/octet-stream",
        b"",
        content,
        b"--BoUnDaRy--",
        b"",
    ]
    return b"\r\n".join(lines)


def test_charsets_that_cannot_decode_text_fall_back_to_raw_bytes():
    for charset in ("base64", "undefined", "idna", "punycode"):
        for content_type, body in (
            ("application/x-www-form-urlencoded", b"name=w\xff"),
            ("multipart/form-data; boundary=BoUnDaRy", _multipart({"a": "b"}, ("f", "f", b"x"))),
        ):
            declared = f"{content_type}; charset={charset}"
            request = factory.generic("POST", "/p/", body, content_type=declared)
            again = factory.generic("POST", "/p/", body, content_type=declared)
            other = factory.generic("POST", "/p/", body + b"!", content_type=declared)
            assert request_fingerprint(request) == request_fingerprint(again), charset
            assert request_fingerprint(request) != request_fingerprint(other), charset


def test_recorded_path_percent_encodes_control_characters():
    request = factory.post("/p/a\x00b\x1b\x7f/?q=%00")
    assert recorded_path(request) == "/p/a%00b%1B%7F/?q=%00"
    assert request_fingerprint(request) != request_fingerprint(factory.post("/p/a%00b%1B%7F/"))
