"""The two-column tables `graphcp run` and `graphcp pd-demo` print (Markdown)."""

from __future__ import annotations


def print_table(rows: list[tuple[str, object]]) -> None:
    w = max(len(k) for k, _ in rows)
    print("| " + "what".ljust(w) + " | value |")
    print("|-" + "-" * w + "-|-------|")
    for k, v in rows:
        print(f"| {k.ljust(w)} | {v} |")
