"""Rendezvous hashing of sessions (gateway.routing.rendezvous) and the policy using it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from gateway.routing import rendezvous


@dataclass(frozen=True)
class Node:
    id: str


NODES = [Node(x) for x in ("a", "b", "c", "d")]


def test_the_choice_does_not_depend_on_the_order_of_the_backends():
    for k in range(200):
        key = f"session-{k}"
        assert rendezvous.pick(key, NODES) == rendezvous.pick(key, list(reversed(NODES)))


def test_sessions_spread_over_the_backends():
    counts: dict[str, int] = {}
    for k in range(4000):
        n = rendezvous.pick(f"s{k}", NODES)
        assert n is not None
        counts[n.id] = counts.get(n.id, 0) + 1
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 800  # about 1000 each


def test_a_backend_leaving_moves_only_its_sessions_each_to_one_second_choice():
    for k in range(500):
        key = f"s{k}"
        first = rendezvous.pick(key, NODES)
        assert first is not None
        rest = [n for n in NODES if n != first]
        second = rendezvous.pick(key, rest)
        # without the first, every process agrees on the second
        assert second == rendezvous.pick(key, list(reversed(rest)))
        # a session on another backend does not move when "a" leaves
        if first.id != "a":
            assert rendezvous.pick(key, [n for n in NODES if n.id != "a"]) == first


def test_the_choice_is_the_same_in_another_process():
    keys = [f"s{k}" for k in range(50)]
    here = [rendezvous.pick(k, NODES).id for k in keys]  # type: ignore[union-attr]
    code = (
        "from dataclasses import dataclass\n"
        "from gateway.routing import rendezvous\n"
        "@dataclass(frozen=True)\nclass N:\n    id: str\n"
        "ns=[N(x) for x in 'abcd']\n"
        f"print(','.join(rendezvous.pick(k, ns).id for k in {keys!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip().split(",") == here


def test_no_backend_no_choice():
    assert rendezvous.pick("s", []) is None
