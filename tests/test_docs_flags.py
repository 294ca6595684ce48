"""The docs' command lines against the parser (issue 31, item 9): every flag a docs usage
line shows exists in that command's ``--help``, with the choices it lists; every flag
``--help`` lists is in a usage line of the docs (docs/cli.md holds them all)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from graphcp.cli.main import build_parser

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
