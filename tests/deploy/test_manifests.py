"""The Kubernetes manifests (``deploy/kubernetes/``): every overlay renders with
``kubectl kustomize``, every object validates offline against the Kubernetes schemas (and
the vendored CRD schemas), and the project's own invariants hold: 2+ gateway replicas, a PDB
over the gateway pods, RBAC exactly as discovery and the restart hook need, probes on
``/health`` and ``/ready``, a gateway config that loads, vLLM's dev-mode and sleep flags,
pinned images, Services that select pods, no secret in the manifests. How rendering and
validation work: :mod:`tests.deploy.manifests`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gateway.config import GatewayConfig, check_secrets, load_config
from tests.deploy.manifests import (
    DEPLOY,
    ROOT,
    Obj,
    all_containers,
    containers,
    env_of,
    named_ports,
    of_kind,
    one,
    pod_labels,
    render,
    selected,
    selects,
    validate,
)

OVERLAYS = ("sim", "vllm-gpu")
GATEWAY = "llm-gateway"  # the gateway's Deployment, ServiceAccount and Service
VLLM_IMAGE = "vllm/vllm-openai:"
# containers that cannot run non-root with a read-only root filesystem, and why
ROOT_ALLOWED = {
    "vllm": "the vLLM image runs as root and writes its compile caches under /",
    "dcgm-exporter": "DCGM's host engine runs as root (as in NVIDIA's own manifests)",
}


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def objs(overlay: str) -> list[Obj]:
    return render(overlay)


def test_every_overlay_is_tested() -> None:
    found = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
    assert found == sorted(OVERLAYS)


def test_every_object_validates(objs: list[Obj]) -> None:
    problems = [p for o in objs for p in validate(o)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        # a misspelt field (strict schemas refuse unknown fields)
        ("Deployment", ["spec", "template", "spec", "containers", 0, "readinesProbe"], {}),
        # a wrong type
        ("Deployment", ["spec", "replicas"], "two"),
        ("PodDisruptionBudget", ["spec", "selector", "matchLabels"], ["a"]),
        # the CRD kinds, through their vendored schemas
        ("ScaledObject", ["spec", "minReplicaCont"], 2),
        ("ScaledObject", ["spec", "triggers", 0, "metadata", "threshold"], 1),
        ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], "15 seconds"),
    ],
)
def test_validation_refuses_a_broken_object(kind: str, path: list[Any], value: Any) -> None:
    """The validation above is not vacuous: one broken field fails it."""
    objs = render("vllm-gpu")
    obj = of_kind(objs, kind)[0]
    assert validate(obj) == []
    node: Any = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    assert validate(obj), f"{kind} with {'.'.join(map(str, path))}={value!r} validated"


# ---- the gateway --------------------------------------------------------------------------


def _config_path(gateway: Obj) -> Path:
    """Where the gateway container's ``--config`` points."""
    (c,) = [c for c in containers(gateway) if c["name"] == "gateway"]
    args = c.get("args", [])
    return Path(args[args.index("--config") + 1])


def gateway_config(
    objs: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> GatewayConfig:
    """The gateway's config as its pods load it: the file of the ConfigMap mounted where
    ``--config`` points, with the container's environment (a Secret's value replaced by a
    stand-in, and the API server's address Kubernetes gives every pod), through
    :func:`gateway.config.load_config` and ``check_secrets``."""
    gw = one(objs, "Deployment", GATEWAY)
    path = _config_path(gw)
    (c,) = [c for c in containers(gw) if c["name"] == "gateway"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
    volumes = gw["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    target = tmp_path / path.name
    target.write_text(cm["data"][path.name])
    for name, e in env_of(c).items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
        else:
            assert "secretKeyRef" in e["valueFrom"], f"env {name}: only Secrets or literals"
            monkeypatch.setenv(name, "stand-in-secret")
    # in a pod Kubernetes always sets these (the API server's Service): in-cluster config
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = load_config(target)
    check_secrets(cfg)
    return cfg


def test_gateway_config_loads(
    objs: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    gw = one(objs, "Deployment", GATEWAY)
    (c,) = [c for c in containers(gw) if c["name"] == "gateway"]
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.port == named_ports([gw])["http"]
    assert cfg.coordination.enabled, "fleet mode: 2+ replicas share state in Redis"
    assert cfg.auth.admin_key is None and cfg.auth.admin_key_env is not None
    assert "secretKeyRef" in env_of(c)[cfg.auth.admin_key_env]["valueFrom"]
    assert cfg.discovery.source == "kubernetes"
    assert cfg.backends == []


def test_discovery_finds_the_vllm_service(
    objs: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The label selector is the one EndpointSlices of a rendered headless Service carry
    (``kubernetes.io/service-name``), its named port is a port of that Service, and the
    GPU metrics URL's port is a port of the backend pods."""
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    kube = cfg.discovery.kubernetes
    assert kube is not None
    key, _, service_name = kube.label_selector.partition("=")
    assert key == "kubernetes.io/service-name"
    svc = one(objs, "Service", service_name)
    assert svc["spec"].get("clusterIP") == "None", "headless: every pod its own endpoint"
    assert kube.port_name in [p["name"] for p in svc["spec"]["ports"]]
    backends = selected(objs, svc["spec"]["selector"])
    assert backends
    url = cfg.discovery.template.gpu_metrics_url
    assert url is not None, "thermal routing needs GPU telemetry"
    port = re.fullmatch(r"http://\{host\}:(\d+)/[\w/]*", url)
    assert port is not None, url
    assert int(port.group(1)) in named_ports(backends).values()


def test_gateway_replicas_probes_and_shutdown(
    objs: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = one(objs, "Deployment", GATEWAY)
    assert gw["spec"]["replicas"] >= 2
    (c,) = [c for c in containers(gw) if c["name"] == "gateway"]
    port = c["ports"][0]["name"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    env = env_of(c)
    assert env["LLM_GATEWAY_COORDINATION__REDIS_URL"]["value"].startswith("redis://redis:")
    one(objs, "Service", "redis")
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # preStop, then SIGTERM's graceful shutdown, fit in the grace period
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = gw["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + cfg.server.graceful_shutdown_s


def test_pdb_covers_the_gateway_pods_only(objs: list[Obj]) -> None:
    gw = one(objs, "Deployment", GATEWAY)
    (pdb,) = of_kind(objs, "PodDisruptionBudget")
    sel = pdb["spec"]["selector"]["matchLabels"]
    matched = [d["metadata"]["name"] for d in selected(objs, sel)]
    assert matched == [GATEWAY]
    # a budget the Deployment can meet while one pod is evicted
    assert 1 <= pdb["spec"]["minAvailable"] < gw["spec"]["replicas"]


# ---- RBAC -------------------------------------------------------------------------------


def granted(objs: list[Obj], sa: str, namespace: str) -> dict[tuple[str, str, str], set[str]]:
    """``(scope, apiGroup, resource) -> verbs`` bound to ServiceAccount ``namespace/sa``;
    scope is the namespace of a RoleBinding or ``"cluster"``."""
    out: dict[tuple[str, str, str], set[str]] = {}
    for binding in [*of_kind(objs, "RoleBinding"), *of_kind(objs, "ClusterRoleBinding")]:
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == sa and s.get("namespace") == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace", "cluster")
        if ref["kind"] == "Role":
            role = one(objs, "Role", ref["name"])
            assert role["metadata"]["namespace"] == scope
        else:
            role = one(objs, "ClusterRole", ref["name"])
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((scope, group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_is_exactly_what_the_gateway_needs(
    objs: list[Obj], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = one(objs, "Deployment", GATEWAY)
    ns = gw["metadata"]["namespace"]
    sa = gw["spec"]["template"]["spec"]["serviceAccountName"]
    one(objs, "ServiceAccount", sa)
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    read = {"get", "list", "watch"}
    want = {(ns, "discovery.k8s.io", "endpointslices"): read}
    kube = cfg.discovery.kubernetes
    assert kube is not None and kube.namespace in (None, ns)
    if kube.watch_nodes:
        want[("cluster", "", "nodes")] = read
    hook = cfg.lifecycle.restart_hook
    if hook is not None and hook.delete_pod:
        # the backends' pods run in the gateway's namespace here
        want[(ns, "", "pods")] = {"delete"}
    assert granted(objs, sa, ns) == want


def test_pods_delete_only_in_the_overlay_with_the_hook(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(overlay)
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    hook = cfg.lifecycle.restart_hook
    deletes = any("delete" in verbs for verbs in granted(objs, GATEWAY, "llm-gateway").values())
    assert deletes == (hook is not None and hook.delete_pod)
    assert deletes == (overlay == "vllm-gpu")


# ---- vLLM -------------------------------------------------------------------------------


def test_vllm_has_the_flags_the_cycles_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render("vllm-gpu")
    cfg = gateway_config(objs, tmp_path, monkeypatch)
    vllm = [(d, c) for d, c in all_containers(objs) if c["image"].startswith(VLLM_IMAGE)]
    assert vllm, "the vllm-gpu overlay runs real vLLM"
    for d, c in vllm:
        env = env_of(c)
        assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"  # /reset_prefix_cache, /sleep
        assert env["VLLM_ENABLE_RESPONSES_API_STORE"]["value"] == "1"
        if cfg.lifecycle.medium.sleep:
            assert "--enable-sleep-mode" in c["args"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
        # a terminating pod keeps serving while the gateway drains it
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        drain = max(cfg.lifecycle.drain_deadline_s, cfg.lifecycle.preempt_deadline_s)
        assert pre_stop[0] == "sleep" and float(pre_stop[1]) >= drain
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > float(pre_stop[1])
        # the sidecar the discovery template's gpu_metrics_url points at
        sidecars = [s for s in containers(d) if "dcgm-exporter" in s["image"]]
        assert [p["containerPort"] for s in sidecars for p in s["ports"]] == [9400]


def test_keda_scales_vllm_on_the_gateway_signal() -> None:
    objs = render("vllm-gpu")
    (so,) = of_kind(objs, "ScaledObject")
    target = one(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert "replicas" not in target["spec"], "KEDA owns the replica count"
    assert so["spec"]["minReplicaCount"] >= 2
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    m = re.fullmatch(r'max\(gateway_autoscale_desired_replicas\{model="([^"]+)"\}\)', query)
    assert m is not None, query
    (c,) = [c for c in containers(target) if c["image"].startswith(VLLM_IMAGE)]
    assert c["args"][c["args"].index("--model") + 1] == m.group(1)


def test_the_metrics_api_alternative_reads_the_flat_answer_of_the_same_model() -> None:
    """The commented metrics-api trigger (KEDA without Prometheus) is valid YAML once
    uncommented, asks the gateway's Service for ``GET /autoscale?model=<vLLM's --model>``
    and reads ``desired_replicas`` with the same AverageValue-of-1 target."""
    import urllib.parse

    import yaml

    text = (DEPLOY / "overlays" / "vllm-gpu" / "scaledobject.yaml").read_text()
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip() == "# - type: metrics-api")
    block = []
    for x in lines[start:]:
        if not x.strip().startswith("#"):
            break
        block.append(x.replace("# ", "", 1))
    (trigger,) = yaml.safe_load("\n".join(block))
    meta = trigger["metadata"]
    assert trigger["metricType"] == "AverageValue" and meta["targetValue"] == "1"
    assert meta["format"] == "json" and meta["valueLocation"] == "desired_replicas"
    url = urllib.parse.urlsplit(meta["url"])
    objs = render("vllm-gpu")
    svc = one(objs, "Service", GATEWAY)
    host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert url.hostname == host
    assert url.port in [p["port"] for p in svc["spec"]["ports"]]
    assert url.path == "/autoscale"
    (model,) = urllib.parse.parse_qs(url.query)["model"]
    (so,) = of_kind(objs, "ScaledObject")
    target = one(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    (c,) = [c for c in containers(target) if c["image"].startswith(VLLM_IMAGE)]
    assert c["args"][c["args"].index("--model") + 1] == model


def test_service_monitor_scrapes_the_gateway(overlay: str) -> None:
    objs = render(overlay)
    monitors = of_kind(objs, "ServiceMonitor")
    if overlay == "sim":
        assert monitors == [], "the sim overlay applies on a cluster without the CRDs"
        return
    (sm,) = monitors
    svc = one(objs, "Service", GATEWAY)
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["path"] == "/metrics"
    assert ep["port"] in [p["name"] for p in svc["spec"]["ports"]]


# ---- every object --------------------------------------------------------------------------


def test_images_are_pinned(objs: list[Obj]) -> None:
    for _, c in all_containers(objs):
        image = c["image"]
        if "@sha256:" in image:
            continue
        name, colon, tag = image.rpartition(":")  # a registry's port has a "/" after it
        assert name and colon and "/" not in tag and tag != "latest", image


def test_every_service_selects_pods_on_declared_ports(objs: list[Obj]) -> None:
    for svc in of_kind(objs, "Service"):
        pods = selected(objs, svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects no Deployment's pods"
        ports = named_ports(pods)
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports or target in ports.values(), (svc["metadata"]["name"], p)


def test_deployments_select_their_own_pods(objs: list[Obj]) -> None:
    for d in of_kind(objs, "Deployment"):
        sel = d["spec"]["selector"]["matchLabels"]
        assert selects(sel, pod_labels(d))
        others = [o["metadata"]["name"] for o in selected(objs, sel) if o is not d]
        assert others == [], f"{d['metadata']['name']}'s selector also takes {others}"


def test_each_object_once(objs: list[Obj]) -> None:
    """One object per kind and name (a replaced ConfigMap is not also kept)."""
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys))
    names = [o["metadata"]["name"].rsplit("-", 1)[0] for o in of_kind(objs, "ConfigMap")]
    assert len(names) == len(set(names)), names


def test_every_namespaced_object_is_in_the_namespace(objs: list[Obj]) -> None:
    (ns,) = of_kind(objs, "Namespace")
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for o in objs:
        if o["kind"] not in cluster_scoped:
            assert o["metadata"].get("namespace") == ns["metadata"]["name"], o["metadata"]["name"]


def test_containers_are_locked_down(objs: list[Obj]) -> None:
    for d, c in all_containers(objs):
        pod = d["spec"]["template"]["spec"]
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert not sc.get("privileged"), c["name"]
        assert pod.get("securityContext", {}).get("seccompProfile") == {"type": "RuntimeDefault"}
        if c["name"] not in ROOT_ALLOWED:
            run_as = {**pod.get("securityContext", {}), **sc}
            assert run_as.get("runAsNonRoot") is True, c["name"]
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert c["resources"]["requests"], c["name"]
        # only the gateway talks to the API server
        wants_token = d["metadata"]["name"] == GATEWAY
        assert pod.get("automountServiceAccountToken") is wants_token, d["metadata"]["name"]


def test_backends_and_redis_admit_only_the_gateway(objs: list[Obj]) -> None:
    """vLLM's dev-mode routes and Redis (no password) are not for the network: a
    NetworkPolicy selects their pods and admits only the gateway's."""
    gw_labels = pod_labels(one(objs, "Deployment", GATEWAY))
    policies = of_kind(objs, "NetworkPolicy")
    for d in of_kind(objs, "Deployment"):
        if d["metadata"]["name"] == GATEWAY:
            continue
        labels = pod_labels(d)
        mine = [p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert mine, f"no NetworkPolicy selects {d['metadata']['name']}'s pods"
        for p in mine:
            assert p["spec"]["policyTypes"] == ["Ingress"]
            for rule in p["spec"]["ingress"]:
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}
                    assert selects(peer["podSelector"]["matchLabels"], gw_labels)
        ports = {
            port["port"] for pol in mine for r in pol["spec"]["ingress"] for port in r["ports"]
        }
        served = {p["containerPort"] for c in containers(d) for p in c.get("ports", [])}
        assert served <= ports, f"{d['metadata']['name']}: ports {served - ports} not admitted"


def test_no_secret_in_the_manifests(objs: list[Obj]) -> None:
    """The admin key (and any other secret) is a Secret made outside the manifests, which
    the README says how to create."""
    assert of_kind(objs, "Secret") == []
    for cm in of_kind(objs, "ConfigMap"):
        for text in cm["data"].values():
            assert not re.search(r"^\s*(admin_key|api_key|key):\s*\S", text, re.M), text
    readme = (ROOT / "README.md").read_text()
    for _, c in all_containers(objs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                cmd = f"create secret generic {ref['name']}"
                assert cmd in readme, f"README does not say `kubectl ... {cmd}`"
                assert f"--from-literal={ref['key']}=" in readme


def test_readme_apply_commands_name_real_overlays() -> None:
    readme = (ROOT / "README.md").read_text()
    applied = re.findall(r"kubectl apply -k ((?:[\w.-]+/)*[\w-]+)", readme)
    assert {Path(p).name for p in applied} >= set(OVERLAYS)
    for p in applied:
        assert (ROOT / p / "kustomization.yaml").is_file(), p
