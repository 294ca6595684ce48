"""The package's structure holds: imports run one way (no cycles), no module imports
another module's private name, and every module imports on its own, whichever
graphcp module a program imports first."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphcp"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(f: Path) -> list[tuple[str, str]]:
    """(module, name) for every ``from graphcp... import name`` and ``import graphcp...``."""
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "graphcp":
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "graphcp"]
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for mod, name in _imports(f):
            target = f"{mod}.{name}" if f"{mod}.{name}" in mods else mod
            # explicit imports only: a package's __init__ that re-exports its modules is
            # run first whatever is imported, and is checked by the fresh-import test
            if target in mods and target != m:
                edges[m].add(target)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_private_name():
    private = [(m, f"{mod}.{name}") for m, f in _modules().items() for mod, name in _imports(f)
               if name.startswith("_") and not name.startswith("__")]
    assert not private, private


def test_every_module_imports_first():
    """Each module imported as the first graphcp module of a fresh import (graphcp's
    modules dropped from sys.modules before each; torch stays, to keep this fast)."""
    script = (
        "import sys, importlib, torch\n"
        f"mods = {sorted(m for m in _modules() if not m.endswith('__main__'))!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'graphcp' or k.startswith('graphcp.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:\n"
        "        if getattr(e, 'name', None) in ('flashinfer', 'triton', 'nvtx'):\n"
        "            continue  # an optional kernel library this machine lacks\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
