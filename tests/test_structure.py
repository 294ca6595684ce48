"""The package's structure holds: its units form layers that import only downwards (no
cycle between top-level units, nor between the sub-units of any package), ``graphcp/``
keeps at most 12 top-level modules, no module imports another module's private name,
and every module imports on its own, whichever graphcp module a program imports first.

A *unit* of a package is one of its direct children: a module, or a subpackage with
everything under it. docs/structure.md draws the layers; :data:`LAYERS` is the rule
they keep: a top-level unit imports only units listed before it."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphcp"

#: top-level units from the bottom up (``graphcp`` is the package's __init__, the public
#: API); a unit may import only units before it. The library ends at ``graphcp``; the
#: applications after it are imported by nothing in the library.
LAYERS = [
    # small shared helpers: the compiled host kernels' decorator, errors, checks, option
    # names, which options combine, the JSONL reader, NVTX markers, the parallel and runtime configs
    "jit", "errors", "options", "combinations", "checks", "jsonl", "nvtx_ranges", "config",
    "dist",        # process groups and collectives
    "mesh",        # the stage's mesh: (dp, cp, attn_tp) coordinates and the named groups
    "cp",          # layouts: which rank owns which tokens (numpy)
    "kv",          # the paged caches, one module a cache mode
    "attention",   # contract, registry, backends, kernels, ring, sparse
    "pd",          # KV export formats and transports (a family picks its format: below the model)
    "model",       # model configs, the family seam and families, decoder layers, the forward context, loader
    "runtime",     # batch, body, capture, pipeline stages, engine, stats
    "graphcp",     # the public API (graphcp/__init__.py)
    # applications
    "jobs", "serve", "tune", "profile", "gpucheck", "cli", "__main__",
]
MAX_TOP_LEVEL_MODULES = 12


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(f: Path) -> list[tuple[str, str]]:
    """(module, name) for every ``from graphcp... import name`` and ``import graphcp...``,
    at module level or inside a function (a lazy import is still a dependency)."""
    out = []
    here = list(f.relative_to(ROOT).with_suffix("").parts)  # graphcp/cp/__init__ -> its package is graphcp.cp
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against this module's package
            base = here[: len(here) - node.level]
            module = ".".join(base + ([node.module] if node.module else []))
            out += [(module, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "graphcp":
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "graphcp"]
    return out


def _targets(f: Path, mods: dict[str, Path]) -> list[str]:
    """The graphcp modules ``f`` imports (``from pkg import module`` names the module)."""
    out = []
    for mod, name in _imports(f):
        target = f"{mod}.{name}" if f"{mod}.{name}" in mods else mod
        if target in mods:
            out.append(target)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the graphcp modules it imports (computed once a run; callers do not change it)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for target in _targets(f, mods):
            # explicit imports only: a package's __init__ that re-exports its modules is
            # run first whatever is imported, and is checked by the fresh-import test
            if target != m:
                edges[m].add(target)
    return edges


def unit_graph(package: str) -> dict[str, set[str]]:
    """The import graph between the units (direct children) of ``package``, with the
    modules behind each edge: ``{unit: {other unit, ...}}``. For ``graphcp`` the package's
    own ``__init__`` is the unit ``graphcp``."""
    depth = package.count(".") + 1
    prefix = package + "."

    def unit(m: str) -> str | None:
        if m == package:
            return package.rsplit(".", 1)[-1] if depth == 1 else None
        if not m.startswith(prefix):
            return None
        return m.split(".")[depth]

    edges: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        u = unit(m)
        if u is None:
            continue
        edges.setdefault(u, set())
        for t in targets:
            v = unit(t)
            if v is not None and v != u:
                edges[u].add(v)
                edges.setdefault(v, set())
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


def layer_violations(edges: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Each import of a unit by one listed at or before it (``"kv -> runtime"``)."""
    rank = {u: i for i, u in enumerate(layers)}
    return [f"{u} -> {v}" for u in sorted(edges) for v in sorted(edges[u]) if rank[v] >= rank[u]]


def _packages() -> list[str]:
    return sorted(m for m, f in _modules().items() if f.name == "__init__.py")


def test_no_import_cycles():
    cycles = find_cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", _packages())
def test_no_cycle_between_units(package):
    """No two units of a package import each other through any path: for ``graphcp``
    its top-level modules and subpackages, and the same inside every subpackage."""
    cycles = find_cycles(unit_graph(package))
    assert not cycles, f"{package}: cycles between its units: " + "; ".join(" -> ".join(c) for c in cycles)


def test_top_level_units_keep_the_layers():
    edges = unit_graph("graphcp")
    assert set(edges) == set(LAYERS), (
        f"top-level units not in LAYERS: {sorted(set(edges) - set(LAYERS))}; "
        f"listed but gone: {sorted(set(LAYERS) - set(edges))} (place a new unit in LAYERS and docs/structure.md)")
    bad = layer_violations(edges, LAYERS)
    assert not bad, "imports that point up or sideways in LAYERS: " + ", ".join(bad)


def test_at_most_12_top_level_modules():
    top = sorted(f.name for f in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of graphcp/: {top}"


def test_a_back_import_is_caught():
    """The checks fail when a deliberate back-import is added: the cache importing the
    runtime closes a cycle through the runtime's own import of the cache."""
    edges = {u: set(vs) for u, vs in unit_graph("graphcp").items()}
    assert "kv" in edges["runtime"]
    edges["kv"].add("runtime")
    cycles = find_cycles(edges)
    assert any(c[0] in ("kv", "runtime") and "kv" in c and "runtime" in c for c in cycles), cycles
    assert "kv -> runtime" in layer_violations(edges, LAYERS)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_private_name():
    private = [(m, f"{mod}.{name}") for m, f in _modules().items() for mod, name in _imports(f)
               if name.startswith("_") and not name.startswith("__")]
    assert not private, private


def test_every_module_imports_first():
    """Each module imported as the first graphcp module of a fresh import (graphcp's
    modules dropped from sys.modules; torch and the other libraries stay, loaded once).
    Python imports a module's parent packages before the module, so whichever module
    comes first, ``graphcp/__init__`` runs first and runs the same way: one fresh
    ``import graphcp``, its public names then resolved (they load on first use, PEP 562),
    stands for every module that loads. Each module it does not load (the applications,
    lazy kernels) is then imported first in a fork of that state, the
    state a fresh import of it reaches before it runs (the package is imported once, not
    ~150 times over)."""
    script = (
        "import importlib, json, os, sys, torch\n"
        "def attempt(m):\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:\n"
        "        if getattr(e, 'name', None) in ('flashinfer', 'triton', 'nvtx'):\n"
        "            return ''  # an optional kernel library this machine lacks\n"
        "        return f'{m}: {type(e).__name__}: {e}'\n"
        "    except Exception as e:\n"
        "        return f'{m}: {type(e).__name__}: {e}'\n"
        "    return ''\n"
        "def export(name):  # graphcp's public names load on first use (PEP 562)\n"
        "    try:\n"
        "        getattr(sys.modules['graphcp'], name)\n"
        "    except Exception as e:\n"
        "        return f'graphcp.{name}: {type(e).__name__}: {e}'\n"
        "    return ''\n"
        "mods = json.loads(sys.argv[1])\n"
        "for m in mods:  # load the third-party libraries once (they stay, as torch does)\n"
        "    attempt(m)\n"
        "for k in [k for k in sys.modules if k == 'graphcp' or k.startswith('graphcp.')]:\n"
        "    del sys.modules[k]\n"
        "bad = [attempt('graphcp')]\n"
        "bad += [] if bad[0] else [export(n) for n in sys.modules['graphcp'].__all__]\n"
        "loaded = set(sys.modules)\n"
        "for m in [m for m in mods if m not in loaded and not bad[0]]:\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(r)\n"
        "        os.write(w, attempt(m).encode()[:60000])\n"
        "        os._exit(0)\n"
        "    os.close(w)\n"
        "    with os.fdopen(r) as f:\n"
        "        out = f.read()\n"
        "    status = os.waitpid(pid, 0)[1]\n"
        "    bad.append(out or ('' if status == 0 else f'{m}: the import ended the process (status {status})'))\n"
        "print('\\n'.join(b for b in bad if b))\n"
        "sys.exit(1 if any(bad) else 0)\n"
    )
    mods = sorted(m for m in _modules() if not m.endswith("__main__"))
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(mods)], check=False, cwd=ROOT,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
