"""The layout of src/eyas stays as docs/architecture.md draws it: every module has a place, the
import graph has no cycle, layers never import a step (or a layer above them), and steps reach
each other only through the folders they write. Lazy imports inside functions, imports under
TYPE_CHECKING and `importlib.import_module("eyas...")` literals all count."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "eyas"

STEPS = {"prepare", "regenerate", "capture", "vocab", "train", "export", "evaluate", "doctor",
         "convert", "pipeline", "demo"}
BASE = {"config", "errors"}  # used by every layer; they import no other eyas module
# modules that may call steps: the CLI (by name, from its table), `eyas run` (chains the steps;
# its up-to-date checks, freshness, load a tokenizer as prepare does) and the demo (it is
# `eyas run` on a built-in tiny target)
DRIVERS = {"__main__": {"cli"}, "cli": STEPS, "pipeline": STEPS | {"freshness"},
           "freshness": {"prepare"}, "demo": {"pipeline"}}
# layer -> the layers it may import (besides itself and the base)
LAYERS = {
    "kernels": set(),
    "store": set(),
    "targets": {"store"},
    "draft": {"kernels", "store", "targets"},
    "dflash": {"kernels", "store", "targets", "draft"},  # a second draft family, on draft's set-up
    "serve": {"kernels", "store", "targets", "draft", "dflash"},
}
DATA = {"assets"}  # package data (the tiny targets' files), not part of the graph


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("").parts
        if len(rel) > 2 and rel[1] in DATA:
            continue
        out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def imports(name: str, path: Path, mods: dict[str, Path]) -> dict[str, int]:
    """eyas modules that `name` imports anywhere in its file -> first line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(module: str, line: int) -> None:
        if module in mods and module != name:
            found.setdefault(module, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                add(full if full in mods else base, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def place(module: str) -> tuple[str, str]:
    """(kind, name): ("root", "eyas"), ("base", "config"), ("step", "train"),
    ("driver", "cli"), ("layer", "draft") or ("unknown", ...)."""
    parts = module.split(".")
    if parts == ["eyas"]:
        return "root", "eyas"
    if len(parts) == 2:
        top = parts[1]
        if top in BASE:
            return "base", top
        if top in STEPS:
            return "step", top
        if top in DRIVERS:
            return "driver", top
        if top in LAYERS:
            return "layer", top  # a layer's __init__
        return "unknown", top
    return ("layer", parts[1]) if parts[1] in LAYERS else ("unknown", parts[1])


def test_every_module_has_a_place():
    unknown = sorted(m for m in modules() if place(m)[0] == "unknown")
    assert not unknown, (f"{unknown}: put each module in a layer folder ({sorted(LAYERS)}) or, "
                         f"for a new `eyas X` step, add it to STEPS here and to docs/architecture.md")


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles (lazy imports count): " + "; ".join(
        " <-> ".join(c) for c in found)


def _violations() -> list[str]:
    bad = []
    for src, deps in graph().items():
        kind, name = place(src)
        for dst, line in sorted(deps.items()):
            dkind, dname = place(dst)
            where = f"{src} (line {line}) imports {dst}"
            if dkind in ("root", "base"):
                continue
            if kind in ("root", "base"):
                bad.append(f"{where}: the base imports no other eyas module")
            elif kind == "layer":
                if dkind in ("step", "driver"):
                    bad.append(f"{where}: a layer never imports a step; move the shared piece "
                               f"down into a layer")
                elif dkind == "layer" and dname != name and dname not in LAYERS[name]:
                    bad.append(f"{where}: {name}/ may use only {sorted(LAYERS[name])}")
            elif kind in ("step", "driver"):
                if dkind in ("step", "driver") and dname not in DRIVERS.get(name, set()):
                    bad.append(f"{where}: steps reach each other only through their folders "
                               f"(manifests); move the shared piece down into a layer")
    return bad


def test_imports_point_down():
    bad = _violations()
    assert not bad, "\n".join(bad)


if __name__ == "__main__":  # the relayout script runs this without pytest
    import sys

    failed = 0
    for test in (test_every_module_has_a_place, test_no_import_cycles, test_imports_point_down):
        try:
            test()
            print(f"ok    {test.__name__}")
        except AssertionError as err:
            failed += 1
            print(f"FAIL  {test.__name__}: {err}")
    sys.exit(1 if failed else 0)
