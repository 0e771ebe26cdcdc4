"""What the gateway does *to* a backend's server: the restart hook (a command, an HTTP call,
or deleting its pod through the Kubernetes API: ``lifecycle.restart_hook``,
:mod:`gateway.fleet.kube_pods`) and vLLM's dev-mode routes (``/sleep``, ``/wake_up``,
``/reset_prefix_cache``). Each is counted; a failure is noted on the backend, never
raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from gateway.config import RestartHook
from gateway.fleet.backend import Backend
from gateway.fleet.clients import ControlClients
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


class BackendHooks:
    """The restart hook ``hook`` (None: none configured, a restart is only logged) and
    vLLM's dev-mode routes, sent with the work client of ``clients``."""

    def __init__(
        self, hook: RestartHook | None, clients: ControlClients, metrics: GatewayMetrics
    ) -> None:
        self.hook = hook
        self.clients = clients
        self.metrics = metrics

    async def run_restart_hook(self, backend: Backend) -> bool:
        """Run the configured restart hook for ``backend`` (none: only logged). True when
        a hook ran successfully."""
        hook = self.hook
        if hook is None:
            log.info("backend %s: no restart hook configured; a restart would go here", backend.id)
            self.metrics.restart_hooks.labels(backend.id, "none").inc()
            return False
        subst = {"backend_id": backend.id, "url": backend.base_url}
        try:
            if hook.command is not None:
                argv = [a.format(**subst) for a in hook.command]
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
                try:
                    async with asyncio.timeout(hook.timeout_s):
                        _, err = await proc.communicate()
                except BaseException:  # timeout, or the gateway stopping: never leave it behind
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(proc.wait(), 5)
                    raise
                ok = proc.returncode == 0
                detail = f"exit {proc.returncode}: {err.decode(errors='replace')[-200:]}"
            elif hook.delete_pod:
                # imported here: the Kubernetes client only loads where it is configured
                from gateway.fleet.kube_pods import delete_pod

                ok, detail = await delete_pod(
                    backend.config.pod, backend.config.namespace, hook.kubeconfig,
                    hook.timeout_s,
                )
            else:
                assert hook.url is not None
                r = await self.clients.work.request(
                    hook.method, hook.url.format(**subst), timeout=hook.timeout_s
                )
                ok = r.status_code < 400
                detail = f"HTTP {r.status_code}"
        except (OSError, TimeoutError, httpx.HTTPError) as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        self.metrics.restart_hooks.labels(backend.id, "ok" if ok else "failed").inc()
        if ok:
            log.info("backend %s: restart hook ran (%s)", backend.id, detail)
        else:
            log.error("backend %s: restart hook failed (%s)", backend.id, detail)
            backend.note_error(f"restart hook failed: {detail}")
        return ok

    async def vllm_post(self, backend: Backend, path: str) -> bool:
        """POST a vLLM dev-mode route; False when absent (404) or failing."""
        headers = {"authorization": f"Bearer {k}"} if (k := backend.api_key) else None
        try:
            r = await self.clients.work.post(f"{backend.base_url}{path}", headers=headers)
        except httpx.HTTPError as e:
            backend.note_error(f"{path}: {type(e).__name__}")
            return False
        if r.status_code == 404:
            log.info(
                "backend %s: %s not supported (404; vLLM needs VLLM_SERVER_DEV_MODE=1)",
                backend.id,
                path,
            )
            return False
        return r.status_code < 300

    async def reset_prefix_cache(self, backend: Backend) -> None:
        """``POST /reset_prefix_cache``; vLLM refuses (``success: false``) while blocks are
        in use, so retry a few times."""
        for _ in range(5):
            headers = {"authorization": f"Bearer {k}"} if (k := backend.api_key) else None
            try:
                r = await self.clients.work.post(
                    f"{backend.base_url}/reset_prefix_cache", headers=headers
                )
            except httpx.HTTPError:
                return
            if r.status_code == 404:
                log.info("backend %s: /reset_prefix_cache not supported (404)", backend.id)
                return
            try:
                if r.status_code == 200 and r.json().get("success", True) is not False:
                    self.metrics.prefix_cache_resets.labels(backend.id).inc()
                    return
            except ValueError:
                return
            await asyncio.sleep(0.5)
