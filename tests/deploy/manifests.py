"""Rendering and offline validation of the Kubernetes manifests (``deploy/kubernetes/``).

``render(overlay)``: ``kubectl kustomize deploy/kubernetes/overlays/<overlay>`` (the Debian
package ``kubernetes-client``, which ``.ci/run`` installs; its kubectl 1.20 embeds kustomize
v2.0.3, and the manifests are written for it as well as for kustomize v5). Without kubectl
the tests skip saying so, except under CI (``CI`` set), where they fail.

``validate(obj)``: offline, no cluster and no network.
  - Built-in kinds: ``kubernetes-validate``'s bundled JSON schemas (generated from the
    Kubernetes OpenAPI specs), its *strict* variant (an unknown field is an error, as the
    API server's strict field validation, kubectl's default since 1.27, makes it), against
    the oldest and the newest Kubernetes version the installed package bundles (1.25 and
    1.37 for kubernetes-validate 1.37.0): an API removed or a field added since fails one.
  - CRD kinds (ServiceMonitor, ScaledObject): kubernetes-validate has no schema for them
    (``SchemaNotFoundError``), so their CRDs' ``openAPIV3Schema`` is vendored in
    ``tests/deploy/schemas/`` (descriptions stripped; source and version in its README) and
    checked with ``jsonschema``, made strict the same way: an object schema that lists
    ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields`` refuses other fields (the API server prunes or,
    under strict validation, refuses them). A kind with neither schema is an error: nothing
    in a rendered overlay goes unchecked.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

Obj = dict[str, Any]


def kubectl() -> str:
    """The ``kubectl`` on PATH; skips the test without one (fails under CI)."""
    found = shutil.which("kubectl")
    if found is None:
        msg = (
            "kubectl not found: the manifest tests render deploy/kubernetes with "
            "`kubectl kustomize` (Debian: apt-get install kubernetes-client; .ci/run does)"
        )
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return found


@functools.cache
def _render(binary: str, overlay: str) -> tuple[Obj, ...]:
    done = subprocess.run(
        [binary, "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize overlays/{overlay} failed:\n{done.stderr}")
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def render(overlay: str) -> list[Obj]:
    """Every object of ``overlays/<overlay>`` as rendered by ``kubectl kustomize`` (a deep
    copy: tests may change it)."""
    return copy.deepcopy(list(_render(kubectl(), overlay)))


def k8s_versions() -> tuple[str, str]:
    """The oldest and the newest Kubernetes version the installed kubernetes-validate
    bundles schemas for (e.g. ``("1.25.0", "1.37.0")``)."""
    versions = all_versions()
    return versions[0], versions[-1]


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its
    ``properties`` and says nothing about other fields (see the module docstring)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if isinstance(out.get("properties"), dict):
        # property names are data, not keywords: recurse into their schemas only
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
    return out


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], Obj]:
    """``(apiVersion, kind) -> strict schema`` of every vendored CRD schema. File names:
    ``<kind lowercase>-<group>-<version>.json``."""
    found: dict[tuple[str, str], Obj] = {}
    for f in SCHEMAS.glob("*.json"):
        kind, rest = f.stem.split("-", 1)
        group, version = rest.rsplit("-", 1)
        schema = json.loads(f.read_text())
        found[(f"{group}/{version}", kind)] = _strict(schema)
    return found


def validate(obj: Obj) -> list[str]:
    """What is wrong with ``obj`` against its schema (empty: valid), for each version of
    :func:`k8s_versions` (built-in kinds) or its vendored CRD schema (custom kinds).
    Raises :class:`AssertionError` for a kind with no schema at all."""
    problems: list[str] = []
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    for version in k8s_versions():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            problems.append(f"{name} (Kubernetes {e.version}): {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            schema = _crd_schemas().get((obj["apiVersion"], obj["kind"].lower()))
            if schema is None:
                raise AssertionError(
                    f"{name}: no schema for {obj['apiVersion']} {obj['kind']} in "
                    f"kubernetes-validate nor in {SCHEMAS} (vendor its CRD's schema)"
                ) from None
            validator = jsonschema.Draft202012Validator(schema)
            for err in validator.iter_errors(obj):
                where = ".".join(str(p) for p in err.path)
                problems.append(f"{name} (CRD schema): {where}: {err.message}")
            break  # one CRD schema, whatever the Kubernetes version
    return problems


# ---- reading the rendered objects ---------------------------------------------------------


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    """The objects of ``kind``, in render order."""
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    """The object ``kind/name``; fails the test when it is not there."""
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind}/{name} in the rendered manifests")


def containers(deployment: Obj) -> list[Obj]:
    """The containers of a Deployment's pod template (init containers too)."""
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def all_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """``(deployment, container)`` for every container of every Deployment."""
    for d in of_kind(objs, "Deployment"):
        for c in containers(d):
            yield d, c


def pod_labels(deployment: Obj) -> dict[str, str]:
    """The labels of a Deployment's pods."""
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"].get("labels", {})
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether an equality selector (``matchLabels`` or a Service's ``selector``) matches."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def env_of(container: Obj) -> dict[str, Obj]:
    """A container's env entries by name."""
    return {e["name"]: e for e in container.get("env", [])}


def named_ports(pods: list[Obj]) -> dict[str, int]:
    """Port name -> container port over the containers of some Deployments."""
    return {
        p["name"]: p["containerPort"]
        for d in pods
        for c in containers(d)
        for p in c.get("ports", [])
        if "name" in p
    }


def selected(objs: list[Obj], selector: dict[str, str]) -> list[Obj]:
    """The Deployments whose pods an equality selector matches."""
    return [d for d in of_kind(objs, "Deployment") if selects(selector, pod_labels(d))]
