"""The live reload's admin calls as the tests make them (issue 18): a running gateway's
config changed and posted back, its backends' ids."""

from __future__ import annotations

from typing import Any

import httpx
import yaml

from tests.lifecycle.support import admin
from tests.support.servers import GatewayThread


def config_text(gw: GatewayThread, backends: dict[str, str], **changes: Any) -> str:
    """``gw``'s running config as YAML with ``backends`` (id -> url) and top-level section
    ``changes`` (fields merged into the section)."""
    data = gw.gateway.cfg.model_dump(mode="json")
    data["backends"] = [{"id": i, "url": u} for i, u in backends.items()]
    for section, fields in changes.items():
        data[section] = {**data[section], **fields}
    return yaml.safe_dump(data)


def post_config(gw: GatewayThread, text: str) -> httpx.Response:
    """``POST /admin/config`` with ``text`` (YAML)."""
    return httpx.post(gw.url + "/admin/config", content=text.encode(),
                      headers={"content-type": "application/yaml"}, timeout=10)


def ids(gw: GatewayThread) -> set[str]:
    """The ids of ``gw``'s backends (``GET /admin/backends``)."""
    return {b["id"] for b in admin(gw.url)}
