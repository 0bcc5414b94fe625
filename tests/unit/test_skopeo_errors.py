"""A failed registry request says what to change (dsecd/fs/skopeo.py)."""

from __future__ import annotations

import pytest

from dsecd.fs.skopeo import _advice, _code, _message

FATAL = 'time="2026-01-01T00:00:00Z" level=fatal msg="{}"\n'


@pytest.mark.parametrize("skopeo_says,code,advice", [
    ('Error parsing image name \\"docker://r:5000/python:3.11\\": reading manifest 3.11 in r:5000/python: '
     'manifest unknown: manifest unknown', "not_found", "images.default_registry"),
    ("reading manifest 1 in r/app: unauthorized: authentication required", "permission", "images.auth_file"),
    ('pinging container registry r:5000: Get \\"https://r:5000/v2/\\": http: server gave HTTP response '
     'to HTTPS client', "io", "images.insecure_registries"),
    ("pinging container registry r: Get https://r/v2/: tls: failed to verify certificate: x509: "
     "certificate signed by unknown authority", "io", "images.certs_dir"),
])
def test_registry_errors_name_the_setting_to_change(skopeo_says, code, advice):
    msg = _message(FATAL.format(skopeo_says))
    assert _code(msg) == code
    assert advice in _advice(code, msg)


def test_an_error_without_known_advice_gets_none():
    assert _advice("io", "connection reset by peer") == ""
