"""The long cycle's restart through the Kubernetes API (``restart_hook.delete_pod: true``):
the gateway deletes the backend's pod with the real client library against the local API
server DOUBLE (``tests/support/kube_api.py``), the new server comes back and the backend
returns to rotation; a backend without a pod name is a failed hook, said as such. Real HTTP
through uvicorn, simulated vLLM backends."""

from __future__ import annotations

from pathlib import Path

from tests.lifecycle.support import Sim, admin, history, metric, metric_samples, wait_state
from tests.support.kube_api import KubeApiDouble
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def test_long_cycle_deletes_the_backends_pod_through_the_api(tmp_path: Path) -> None:
    """Long cycle every 3 s (A due at ~1.5 s, B at ~3 s); ``restart_hold_s`` 60 s, so only the
    restart itself (A's simulator killed and started again once its pod is deleted: the new
    pod) ends A's hold. A names its pod (``llm/vllm-a``): the double records its DELETE and A
    goes ``restart_scheduled`` -> ``restarted`` -> warm. B names none: its hook fails
    (counted ``failed``, the reason on the backend) and no other pod is touched."""
    a, b = Sim("A"), Sim("B")
    gw: GatewayThread | None = None
    with KubeApiDouble() as kube:
        kube.put_pod("vllm-a", "llm")
        kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
        try:
            cfg = gateway_config(
                [{"id": "a", "url": a.url, "pod": "vllm-a", "namespace": "llm"},
                 {"id": "b", "url": b.url}],
                lifecycle={"long": {"every_s": 3.0}, "check_interval_s": 0.1,
                           "restart_hold_s": 60.0,
                           "restart_hook": {"delete_pod": True, "kubeconfig": kubeconfig,
                                            "timeout_s": 10}})
            gw = GatewayThread(cfg)
            gw.start(wait_ready=False)
            gw.wait_ready(timeout=20, routable=2)
            assert wait_for(lambda: kube.deleted_pods == [("llm", "vllm-a")], 15), \
                kube.deleted_pods
            a.kill()  # the deleted pod's server goes away, its replacement starts
            a.restart()
            wait_state(gw.url, "a", "warm", timeout=20)
            assert wait_for(lambda: "no pod" in (admin(gw.url, "b")["last_error"] or ""), 15)
            h = history(gw.url, "a")
            i = h.index(("warm", "draining", "restart_scheduled"))
            assert h[i + 1] == ("draining", "cold", "restarted"), h
            m = metric_samples(gw.url)
            assert metric(m, "gateway_restart_hooks_total", backend="a", result="ok") >= 1
            assert metric(m, "gateway_restart_hooks_total", backend="b", result="failed") >= 1
            # (A's next long cycle may delete again: the same pod, never another)
            deletes = {p for m_, p, _ in kube.requests if m_ == "DELETE"}
            assert deletes == {"/api/v1/namespaces/llm/pods/vllm-a"}
        finally:
            if gw is not None:
                gw.stop()
            a.stop()
            b.stop()
