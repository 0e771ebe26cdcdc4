"""The restart hook through the Kubernetes API (``lifecycle.restart_hook.delete_pod: true``):
delete the backend's pod with ``CoreV1Api.delete_namespaced_pod`` (its Deployment or
StatefulSet starts a new one), so the image needs no ``kubectl`` binary.

RBAC the gateway's service account needs: ``pods`` (core group) ``delete`` in the backends'
namespace (a Role). The pod is the backend's ``pod`` in its ``namespace`` (Kubernetes
discovery fills both from the EndpointSlice's ``targetRef``; a static backend names them in
its ``backends:`` entry); no namespace: the gateway's own (its service account's), else
``default``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from kubernetes_asyncio.client import ApiException, CoreV1Api
from kubernetes_asyncio.config import ConfigException

from gateway.fleet.kube_client import api_client, api_error, default_namespace


async def delete_pod(
    pod: str | None, namespace: str | None, kubeconfig: str | None, timeout_s: float
) -> tuple[bool, str]:
    """Delete ``pod`` in ``namespace`` (None: the gateway's own) with the credentials of
    ``kubeconfig`` (None: in-cluster, then ``~/.kube/config``), within ``timeout_s``
    seconds. Returns (deleted, one line saying what happened); never raises but
    ``CancelledError``. No pod name is a failure said as such."""
    if not pod:
        return False, (
            "no pod to delete: the backend has no 'pod' (Kubernetes discovery fills it from "
            "the EndpointSlice's targetRef; a static backend names it in its entry)"
        )
    ns = namespace or default_namespace()
    try:
        async with asyncio.timeout(timeout_s):
            client = await api_client(kubeconfig)
            try:
                await CoreV1Api(client).delete_namespaced_pod(pod, ns)
            finally:
                await client.close()
    except ApiException as e:
        return False, f"deleting pod {ns}/{pod}: {api_error(e)}"
    except (aiohttp.ClientError, TimeoutError, OSError, ConfigException, ValueError) as e:
        return False, f"deleting pod {ns}/{pod}: {type(e).__name__}: {e}".rstrip(": ")
    return True, f"pod {ns}/{pod} deleted"


__all__ = ["delete_pod"]
