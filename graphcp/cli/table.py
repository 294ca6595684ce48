"""The two-column tables `graphcp run` and `graphcp pd-demo` print (Markdown), and how
the commands name a run's ranks."""

from __future__ import annotations


def print_table(rows: list[tuple[str, object]]) -> None:
    w = max(len(k) for k, _ in rows)
    print("| " + "what".ljust(w) + " | value |")
    print("|-" + "-" * w + "-|-------|")
    for k, v in rows:
        print(f"| {k.ljust(w)} | {v} |")


def ranks_text(pp: int, tp: int, cp: int, dp: int = 1) -> tuple[str, str]:
    """(label, value) naming a run's ranks: ``CP = TP`` without attention TP (as before
    the mesh), else the mesh, e.g. ``4 = CP 2 x attention TP 2; MLP/MoE TP 4``."""
    attn = tp // (dp * cp)
    if attn == 1 and dp == 1:
        return ("ranks (CP = TP)", str(cp)) if pp == 1 else ("ranks (PP x CP, CP = TP)", f"{pp} stages x {cp}")
    mesh = (f"DP {dp} x " if dp > 1 else "") + f"CP {cp} x attention TP {attn}; MLP/MoE TP {tp}"
    return ("ranks (mesh)", f"{tp} = {mesh}") if pp == 1 else ("ranks (PP x mesh)", f"{pp} stages x ({tp} = {mesh})")
