"""The pieces of `save_weights_external` (orbit/serve/exports.py): files encrypted to age recipients
decrypt with their identities; download links open after a restart (the secret is kept), and not
once tampered with, signed elsewhere or past their hour. The whole path through the SDK and the
cookbook: tests/test_tinker.py."""

from __future__ import annotations

import os

import pyrage
import pytest

from orbit.serve import exports
from orbit.serve.futures import NotFound, Refused


def test_files_encrypted_to_each_recipient_decrypt_with_its_identity(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(os.urandom(1000))
    plain = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ids = [pyrage.x25519.Identity.generate() for _ in range(2)]
    exports.encrypt(tmp_path, exports.recipients([str(i.to_public()) for i in ids]))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n + ".age" for n in plain)
    for identity in ids:
        for name, data in plain.items():
            assert pyrage.decrypt((tmp_path / (name + ".age")).read_bytes(), [identity]) == data


def test_a_recipient_that_is_not_a_key_or_too_many_are_refused():
    with pytest.raises(Refused, match="'age1nope' is not an age recipient"):
        exports.recipients(["age1nope"])
    key = str(pyrage.x25519.Identity.generate().to_public())
    with pytest.raises(Refused, match="11; at most 10"):
        exports.recipients([key] * 11)
    assert exports.recipients(None) == []


def test_a_link_opens_after_a_restart_and_not_tampered_elsewhere_or_late(tmp_path, monkeypatch):
    secret = tmp_path / "link-secret"
    link = exports.Link("tenant", "tinker://c/external_weights/x", "adapter_config.json")
    urls, expires = exports.Links(secret).urls("http://127.0.0.1:1/", [link])
    url = urls["adapter_config.json"]
    token = url.split(exports.ROUTE, 1)[1]
    assert url.startswith("http://127.0.0.1:1" + exports.ROUTE)
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    assert exports.Links(secret).open(token) == link  # a new service on the same directory
    with pytest.raises(NotFound, match="not a download link"):
        exports.Links(secret).open(token[:-2] + ("aa" if token[-2:] != "aa" else "bb"))
    with pytest.raises(NotFound, match="not a download link"):
        exports.Links(tmp_path / "other-secret").open(token)
    import itsdangerous.timed

    later = expires + 1
    monkeypatch.setattr(itsdangerous.timed.time, "time", lambda: later)
    with pytest.raises(NotFound, match="expired"):
        exports.Links(secret).open(token)


def test_a_secret_file_that_is_empty_or_short_is_not_signed_with(tmp_path):
    (tmp_path / "link-secret").write_text("")
    with pytest.raises(RuntimeError, match="not a secret this service wrote"):
        exports.Links(tmp_path / "link-secret")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".secret-")]
