"""The docs' command lines against the parser (issue 31, item 9): every flag a docs usage
line shows exists in that command's ``--help``, with the choices it lists; every flag
``--help`` lists is in a usage line of the docs (docs/cli.md holds them all). And the
docs' facts that the code can check (issue 41): every file and module they name exists,
docs/parallel.md's rank numbering and group tables are the mesh's, and the refusals
docs/dsv4.md lists are the declared ones (graphcp/combinations.py), all of them."""

from __future__ import annotations

import argparse
import importlib
import re
from itertools import product
from pathlib import Path

from graphcp.cli.main import build_parser
from graphcp.combinations import AXES, classify_pairs
from graphcp.config import ParallelConfig
from graphcp.mesh import global_rank, rank_groups

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "profiles" / "README.md",
        ROOT / "workloads" / "README.md"]
COMMANDS: dict[str, argparse.ArgumentParser] = build_parser().commands
#: a usage line: `graphcp CMD ...` (or `python -m graphcp CMD ...`; `graphcp A|B ...` for
#: flags several commands share) in a code block, with its continuation lines (indented,
#: starting with a flag or an optional group)
START = re.compile(r"\s*(?:\$ )?(?:python -m )?graphcp ([a-z-]+(?:\|[a-z-]+)*)(?![a-z-])(.*)")
CONTINUED = re.compile(r"\s+[\[-]")
FLAG = re.compile(r"(--[a-z][a-z0-9-]*)(?:[ =]([a-z0-9][a-z0-9.-]*(?:\|[a-z0-9][a-z0-9.-]*)+))?")


def usage_lines() -> list[tuple[str, str, str]]:
    """(file, command, the line and its continuations) for every usage line of the docs."""
    out: list[tuple[str, str, str]] = []
    for doc in DOCS:
        block, current = False, None
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                block, current = not block, None
                continue
            m = START.match(line) if block else None
            if m and all(c in COMMANDS for c in m.group(1).split("|")):
                current = [doc.name, m.group(1), m.group(2)]
                out.append(current)  # type: ignore[arg-type]
            elif current is not None and CONTINUED.match(line):
                current[2] += " " + line
            else:
                current = None
    return [(doc, cmd, text) for doc, cmds, text in out for cmd in cmds.split("|")]


def shown_flags() -> dict[tuple[str, str], list[tuple[str, str | None]]]:
    """(command, flag) -> where it is shown and the choices listed with it (``a|b|c``)."""
    shown: dict[tuple[str, str], list[tuple[str, str | None]]] = {}
    for doc, cmd, text in usage_lines():
        for flag, choices in FLAG.findall(text.split("  #")[0]):
            shown.setdefault((cmd, flag), []).append((doc, choices or None))
    return shown


def test_the_docs_show_usage_lines_of_every_command():
    assert {cmd for _, cmd, _ in usage_lines()} == set(COMMANDS)


def test_every_flag_a_docs_usage_line_shows_exists_with_its_choices():
    bad = []
    for (cmd, flag), places in shown_flags().items():
        action = COMMANDS[cmd]._option_string_actions.get(flag)
        if action is None:
            bad.append(f"{cmd} {flag} ({places[0][0]}): not in graphcp {cmd} --help")
            continue
        for doc, choices in places:
            if choices is not None and action.choices is not None and set(choices.split("|")) != set(action.choices):
                bad.append(f"{cmd} {flag} {choices} ({doc}): --help has {'|'.join(action.choices)}")
    assert not bad, "\n".join(bad)


def test_every_help_flag_is_in_a_docs_usage_line():
    shown = shown_flags()
    missing = []
    for cmd, parser in COMMANDS.items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if flags and not any((cmd, f) in shown for f in flags):  # --x / --no-x: either
                missing.append(f"graphcp {cmd} {flags[0]}")
    assert not missing, "flags in --help that no docs usage line shows:\n" + "\n".join(missing)


def test_the_checks_catch_a_stale_line(monkeypatch):
    """The parsing finds what it should: a made-up flag and a short choice list fail."""
    assert ("prefill", "--kv-cache") in shown_flags()
    stale = "    graphcp pd-demo [--kv-cache replicated|layer-split] [--no-such-flag]\n"
    found = [f for f in FLAG.findall(START.match(stale).group(2))]
    assert ("--kv-cache", "replicated|layer-split") in found and ("--no-such-flag", "") in found


#: a path of the repository a doc names (``graphcp/kv/paged.py``, ``tests/test_mesh.py``)
PATH = re.compile(r"(?<![\w/.-])((?:graphcp|tests|benchmarks|scripts|examples)/[\w./-]*\w)")
#: a module a doc names (``graphcp.pd.export``); its attributes may follow
MODULE = re.compile(r"(?<![\w/.])(graphcp(?:\.\w+)+)(?![\w-])")  # (not a file: graphcp.nsys-rep)
#: names under graphcp that are not modules: a logger, an entry-point group
NOT_MODULES = {"graphcp.exchange", "graphcp.families"}


def _importable(name: str) -> bool:
    """``name`` is a module, or a module's attribute chain."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_file_and_module_the_docs_name_exists():
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        bad += [f"{where}: {p}" for p in sorted(set(PATH.findall(text))) if not (ROOT / p).exists()]
        bad += [f"{where}: {m}" for m in sorted(set(MODULE.findall(text)))
                if m not in NOT_MODULES and not _importable(m)]
    assert not bad, "the docs name what is not there:\n" + "\n".join(bad)


def _section(doc: str, heading: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_the_mesh_the_parallel_doc_draws_is_the_mesh():
    """docs/parallel.md: the global rank formula, the T = 4, C = 2 table of groups and the
    T = 8, C = 2, D = 2 groups, against graphcp.mesh."""
    text = _section("parallel.md", "## Degrees and ranks")
    formula = re.search(r"global rank\s+`([^`]+)`", text).group(1)  # `s T + (d C + c) A + a`
    expr = re.sub(r"(\w|\))\s+(?=[\w(])", r"\1 * ", formula)  # juxtaposition is a product
    for P, D, C, A in ((2, 1, 2, 2), (1, 2, 2, 2), (2, 1, 4, 1), (1, 2, 1, 4)):
        par = ParallelConfig(tp_size=D * C * A, cp_size=C, dp_size=D, pp_size=P)
        for s_, d, c, a in product(range(P), range(D), range(C), range(A)):
            got = eval(expr, {}, {"s": s_, "d": d, "c": c, "a": a, "T": par.tp_size, "C": C, "A": A})
            assert got == global_rank(par, s_, d, c, a), (formula, P, D, C, A)
    rows = re.findall(r"^\| (\d+) \| \((\d+), (\d+)\) \| \{([\d, ]+)\} \| \{([\d, ]+)\} \| \{([\d, ]+)\} \|$", text,
                      re.M)
    assert len(rows) == 4
    for rank, cp, at, attn_tp, cp_group, ffn in rows:
        groups = rank_groups(int(rank), ParallelConfig(tp_size=4, cp_size=2))
        ints = lambda x: [int(v) for v in x.split(",")]  # noqa: E731
        assert (ints(attn_tp), ints(cp_group), ints(ffn)) == (groups["attn_tp"], groups["cp"], groups["ffn"]), rank
    m = re.search(r"rank `([^`]+)` is in\s+`attn_tp` \{([^}]+)\},\s+`cp` \{([^}]+)\}, `dp` \{([^}]+)\}", text)
    assert m, "docs/parallel.md: the T = 8, C = 2, D = 2 sentence"
    par = ParallelConfig(tp_size=8, cp_size=2, dp_size=2)
    for d, c, a in product(range(2), range(2), range(2)):
        env = {"d": d, "c": c, "a": a}
        ev = lambda e: eval(re.sub(r"(\d)(?=[a-z])", r"\1 * ", e), {}, env)  # noqa: E731
        groups = rank_groups(ev(m.group(1)), par)
        for name, members in zip(("attn_tp", "cp", "dp"), m.groups()[1:]):
            assert sorted(ev(x) for x in members.split(",")) == groups[name], (name, d, c, a)


def test_the_refusals_the_v4_doc_lists_are_the_declared_ones():
    """docs/dsv4.md's table of what a V4 model refuses holds exactly the pairs with the
    model that graphcp/combinations.py refuses, declared or by implication."""
    by_flag = {a.flag: a for a in AXES.values()}
    listed = set()
    for row in re.findall(r"^\| (`(?:--|graphcp )[^|]+) \|", _section("dsv4.md", "## What is refused"), re.M):
        axis = None
        for token in re.findall(r"`([^`]+)`", row):  # `--flag value`, `another value`, `--switch`, `graphcp cmd`
            if token in by_flag:  # a command or a switch: the axis on
                axis, value = by_flag[token], "on"
            elif token.startswith("--"):
                flag, _, value = token.partition(" ")
                axis, value = by_flag[flag], value or "on"
            else:
                value = token
            listed.add((axis.key, value))
    _, refused, implied = classify_pairs()
    declared = {next(kv for kv in pair if kv[0] != "model") for pair, _ in refused + implied
                if ("model", "dsv4") in pair}
    assert listed == declared


def test_the_moe_doc_divides_by_the_ranks_the_code_divides_by():
    """docs/moe.md: the experts split over the stage's tp_size ranks (C x A x D), and a
    split that does not divide is refused naming ``num_experts`` and ``cp_size``, or
    ``tp_size`` under attention TP or DP; so the code refuses (and allows)."""
    import pytest

    from graphcp.errors import ConfigError
    from graphcp.model.config import ModelConfig
    from graphcp.model.family import family_of
    from graphcp.model.presets import PRESETS

    text = " ".join((ROOT / "docs" / "moe.md").read_text().split())
    assert "`tp_size` = C x A x D" in text
    assert "naming `num_experts` and `cp_size`, or `tp_size` under attention TP or DP" in text
    cfg = ModelConfig.from_hf_dict(PRESETS["default-moe"])  # 16 experts
    family = family_of(cfg)
    for par, degree in ((ParallelConfig(cp_size=32), "cp_size=32"), (ParallelConfig(tp_size=32, cp_size=4), "tp_size=32"),
                        (ParallelConfig(tp_size=32, cp_size=4, dp_size=8), "tp_size=32")):
        with pytest.raises(ConfigError, match=rf"num_experts=16 does not divide by {degree}"):
            family.check_parallel(cfg, par, "config.json", "ep")
    family.check_parallel(cfg, ParallelConfig(tp_size=8, cp_size=2, dp_size=2), "config.json", "ep")  # 16 / 8
