"""Who counts as a loopback client for the admin API (issue 20, :mod:`gateway.api.access`),
and the constant-time key checks (:mod:`gateway.core.keys`): pure functions of an ASGI
scope's client and headers."""

from __future__ import annotations

import pytest

from gateway.api.access import admin_refusal, direct_loopback, is_loopback_host
from gateway.core.keys import key_matches, key_table


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
    ("::ffff:127.0.0.1", True),  # a dual-stack listener's view of an IPv4 loopback client
    ("::ffff:192.0.2.2", False), ("192.0.2.2", False), ("10.0.0.1", False),
    ("fe80::1%eth0", False), ("0.0.0.0", False), ("testclient", False), ("", False),
    (None, False),
])
def test_loopback_hosts(host: str | None, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def _scope(host: str, *headers: tuple[bytes, bytes]) -> dict[str, object]:
    return {"client": (host, 40000), "headers": list(headers)}


def test_a_relayed_request_is_never_loopback() -> None:
    assert direct_loopback(_scope("127.0.0.1"))
    for name in (b"X-Forwarded-For", b"forwarded", b"x-real-ip", b"via"):
        assert not direct_loopback(_scope("127.0.0.1", (name, b"127.0.0.1")))
    assert not direct_loopback({"headers": []})  # no client (a Unix socket)


def test_admin_refusals() -> None:
    remote = admin_refusal(None, _scope("192.0.2.2"))
    assert remote is not None and (remote.status, remote.type, remote.code) == (
        403, "permission_error", "admin_loopback_only")
    assert admin_refusal(None, _scope("::1")) is None
    keyed = admin_refusal("k3y", _scope("127.0.0.1"))  # a key binds loopback too
    assert keyed is not None and keyed.status == 401
    assert admin_refusal("k3y", _scope("192.0.2.2", (b"authorization", b"Bearer k3y"))) is None
    assert admin_refusal("k3y", _scope("192.0.2.2", (b"authorization", b"Basic k3y"))) is not None


def test_keys_compare_by_digest() -> None:
    assert key_matches(b"secret", "secret") and not key_matches(b"secre", "secret")
    assert not key_matches(None, "secret")
    table = key_table([("a", 1), ("b", 2)])
    assert len(table) == 2 and all(len(k) == 32 for k in table)
    with pytest.raises(ValueError, match="same secret"):
        key_table([("a", 1), ("a", 2)])
