"""Layering rule of DESIGN.md: dips.algo is pure math.

It imports nothing from the rest of dips but the configuration layer below it (dips.spec), and
nothing that touches sockets, threads, processes, event loops, the wall clock or the environment.
"""

from __future__ import annotations

import ast
from pathlib import Path

ALGO_DIR = Path(__file__).resolve().parents[2] / "src" / "dips" / "algo"
FORBIDDEN = {"socket", "threading", "time", "zmq", "grpc", "subprocess", "asyncio"}


def violations(source: str, package: str = "dips.algo") -> list[str]:
    """Return one message per forbidden import / env read in `source` (a module of `package`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Resolve relative imports against the package of the module.
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            if names[0] == "os":
                found += [f"line {node.lineno}: from os import {a.name}" for a in node.names
                          if a.name in {"environ", "getenv", "putenv"}]
        elif isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "putenv"}:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"line {node.lineno}: os.{node.attr}")
        for name in names:
            top = name.split(".")[0]
            if top in FORBIDDEN:
                found.append(f"line {node.lineno}: imports {name}")
            if (top == "dips" and not any(name == p or name.startswith(p + ".")
                                          for p in ("dips.algo", "dips.spec"))):
                found.append(f"line {node.lineno}: imports {name} outside dips.algo")
    return found


def test_checker_detects_violations():
    bad = (
        "import time\nimport socket as s\nfrom threading import Thread\nimport zmq.asyncio\n"
        "from grpc import aio\nimport subprocess\nimport asyncio\nfrom dips.wire import x\n"
        "import dips.roles\nfrom .. import train\nfrom ..wire import codec\nimport os\n"
        "v = os.environ['X']\nw = os.getenv('Y')\nfrom os import environ\n"
    )
    found = violations(bad)
    assert len(found) == 14, found
    good = ("import math\nimport torch\nfrom dips.algo.penalty import decide\nfrom . import outer\n"
            "from dips.spec import PenaltyConfig\n")
    assert violations(good) == []


def test_algo_modules_respect_layering():
    files = sorted(ALGO_DIR.glob("*.py"))
    assert len(files) >= 7, files  # the scan must actually see the package
    problems = {}
    for path in files:
        found = violations(path.read_text(encoding="utf-8"))
        if found:
            problems[path.name] = found
    assert problems == {}
