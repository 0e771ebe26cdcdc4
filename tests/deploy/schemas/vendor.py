"""Vendor one version of a CRD's schema for the manifest tests (``tests/deploy/manifests.py``):
its ``openAPIV3Schema`` as JSON, descriptions stripped (they do not take part in validation),
named ``<kind lowercase>-<group>-<version>.json``.

    python tests/deploy/schemas/vendor.py CRD.yaml VERSION   # writes the file beside this one
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strip(node: Any) -> Any:
    """``node`` without its ``description`` strings (a property *named* description stays)."""
    if isinstance(node, dict):
        return {
            k: strip(v)
            for k, v in node.items()
            if not (k == "description" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(crd_path: str, version: str) -> None:
    """Write the schema of ``version`` of the CRD in ``crd_path``."""
    crd = yaml.safe_load(Path(crd_path).read_text())
    spec = crd["spec"]
    for v in spec["versions"]:
        if v["name"] == version:
            name = f"{spec['names']['kind'].lower()}-{spec['group']}-{version}.json"
            out = Path(__file__).parent / name
            schema = strip(v["schema"]["openAPIV3Schema"])
            out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            print(out)
            return
    raise SystemExit(f"{crd_path}: no version {version}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
