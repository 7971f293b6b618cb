"""The layering rule of DESIGN.md as a test of the whole import graph.

Layers, lowest first: ``spec`` ← ``algo`` ← ``wire`` ← ``roles`` ← ``train`` ← ``emu`` ← ``node`` ←
``baselines`` ← ``sim`` ← ``bench`` ← ``cli``. A module may import its own layer and the layers below it,
never one above (lazy imports inside functions count too). The top-level modules ``dips``
(the public API), ``dips.cli``, ``dips.placement_cli``, ``dips.pki_cli``, ``dips.cluster`` and
``dips.torchrun`` form the ``cli``
layer. A new back-arrow fails here, naming the file, line and import.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dips"
ORDER = ["spec", "algo", "wire", "roles", "train", "emu", "node", "baselines", "sim", "bench",
         "cli"]
TOP_LEVEL = {"__init__": "cli", "cli": "cli", "placement_cli": "cli", "pki_cli": "cli",
             "cluster": "cli", "torchrun": "cli"}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name inside ``dips`` (None outside dips)."""
    parts = module.split(".")
    if parts[0] != "dips":
        return None
    if len(parts) == 1:
        return "cli"
    if parts[1] in ORDER:
        return parts[1]
    return TOP_LEVEL.get(parts[1], "unknown:" + parts[1])


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def back_arrows(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        src_layer = layer_of(module_name(path))
        for line, target in imports(path):
            dst = layer_of(target)
            if dst is None or dst == src_layer:
                continue
            if dst not in ORDER or src_layer not in ORDER or ORDER.index(dst) > ORDER.index(src_layer):
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {src_layer} imports {target} ({dst})")
    return found


def test_the_checker_finds_a_back_arrow(tmp_path):
    fake = SRC / "wire" / "_fake_for_test.py"
    assert layer_of("dips.wire.x") == "wire" and layer_of("dips") == "cli"
    assert layer_of("numpy") is None and layer_of("dips.new_thing").startswith("unknown")
    try:
        fake.write_text("from dips.roles.leader import Leader\nfrom dips.algo import decide\n"
                        "def f():\n    from ..bench import compare\n")
        found = back_arrows([fake])
    finally:
        fake.unlink()
    assert len(found) == 2 and "imports dips.roles.leader" in found[0]
    assert "dips.bench" in found[1]


def test_no_module_imports_a_layer_above_it():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 80  # the scan must see the package
    assert back_arrows(files) == []
