"""``coordination.redis_url`` as an operator types it: a URL the Redis client cannot use is
refused when the config is loaded (``check-config`` and ``serve`` say which field and why,
exit status 2, no traceback at startup), and the URL's password never shows, neither in that
message nor in the replica's logs about the store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

CONFIG = """
server: {host: 127.0.0.1, port: 18999}
backends:
  - {id: a, url: "http://127.0.0.1:9", models: [m]}
"""


def check_config(tmp_path: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(CONFIG)
    env = {**os.environ, "LLM_GATEWAY_COORDINATION__REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", "-c", str(cfg)],
        env=env, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1:6379", "redis://"),  # wrong scheme
        ("redis://:s3cret@127.0.0.1:notaport/0", "Port"),  # bad port, password in it
        ("redis://127.0.0.1:6379/zero", "database"),  # redis-py would quietly use db 0
    ],
)
def test_unusable_redis_url_is_refused_at_load_with_its_password_hidden(tmp_path, url, says):
    r = check_config(tmp_path, url)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "coordination.redis_url" in out and says in out, out
    assert "Traceback" not in out and "s3cret" not in out, out


@pytest.mark.parametrize(
    "url", ["redis://:pw@127.0.0.1:6379/0", "rediss://redis.internal", "unix:///run/redis.sock"]
)
def test_documented_redis_url_forms_are_accepted(tmp_path, url):
    r = check_config(tmp_path, url)
    assert r.returncode == 0, r.stdout + r.stderr


def test_store_logs_never_show_the_password(redis_server, caplog):
    """A password the store refuses (this Redis has none) takes the replica to fallback;
    the warning names the store by its URL without the password."""
    url = redis_server.url.replace("redis://", "redis://:s3cret@")
    cfg = gateway_config([{"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
                         coordination={"redis_url": url, "replica_id": "r1"})
    caplog.set_level(logging.INFO, logger="gateway.coord")
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        assert wait_for(lambda: any("shared store" in r.getMessage() or "starts without"
                                    in r.getMessage() for r in caplog.records), 10)
    finally:
        gw.stop()
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "gateway.coord")
    assert "shared store" in text or "starts without" in text, text
    assert "s3cret" not in text, text
