"""The Kubernetes API client the gateway's Kubernetes parts share (discovery's
:mod:`gateway.fleet.kube_source`, the restart hook's :mod:`gateway.fleet.kube_pods`): the
official async client, ``kubernetes_asyncio``, configured per call site (never its
process-wide default configuration, so several gateways can run in one process).

Where the credentials come from: a ``kubeconfig`` file when one is named; otherwise the
pod's service account (in-cluster config: ``KUBERNETES_SERVICE_HOST`` / ``_PORT`` and the
token and CA under :data:`SERVICE_ACCOUNT_DIR`), and outside a cluster ``$KUBECONFIG`` or
``~/.kube/config``.
"""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, ApiException, Configuration
from kubernetes_asyncio.config import ConfigException

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service account: ``token``, ``ca.crt``, ``namespace``."""


async def api_client(kubeconfig: str | None) -> ApiClient:
    """A new API client (the caller closes it: ``await client.close()``) configured from
    ``kubeconfig`` (a file), or None: in-cluster config, else ``$KUBECONFIG`` /
    ``~/.kube/config``. Raises ``ConfigException`` or ``OSError`` when none can be read."""
    cfg = Configuration()
    if kubeconfig is not None:
        if _missing(kubeconfig):
            # the library would say "Expected key current-context": say what is wrong
            raise ConfigException(f"kubeconfig {kubeconfig}: no such file")
        await kube_config.load_kube_config(
            config_file=kubeconfig, client_configuration=cfg, persist_config=False
        )
    else:
        try:
            kube_config.load_incluster_config(client_configuration=cfg)
        except ConfigException as in_cluster:
            try:
                await kube_config.load_kube_config(
                    client_configuration=cfg, persist_config=False
                )
            except ConfigException as e:
                raise ConfigException(
                    f"no in-cluster config ({in_cluster}) and no usable kubeconfig ({e})"
                ) from None
    return ApiClient(configuration=cfg)


def _missing(path: str) -> bool:
    """Whether no file is at ``path`` (one stat: too short to hand to a thread)."""
    return not Path(path).expanduser().is_file()


def api_error(e: ApiException) -> str:
    """One line for an API error: ``HTTP <status> <reason>: <the Status's message>``. The
    API server explains itself in the body's ``Status.message`` (an RBAC refusal names the
    service account, verb, resource and namespace; a bad label selector says what does not
    parse), which ``ApiException``'s own text buries in several lines."""
    head = f"HTTP {e.status} {str(e.reason or '').splitlines()[0] if e.reason else ''}".rstrip()
    try:
        body = json.loads(e.body) if e.body else None
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return f"{head}: {message}" if message else head


def default_namespace(service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> str:
    """The gateway pod's own namespace (its service account's ``namespace`` file), else
    ``default`` (outside a cluster)."""
    try:
        ns = (service_account_dir / "namespace").read_text().strip()
    except OSError:
        return "default"
    return ns or "default"


__all__ = ["SERVICE_ACCOUNT_DIR", "api_client", "api_error", "default_namespace"]
