"""Range summaries of a profile: per rank, then merged across ranks.

Input is a list of :class:`RangeEvent` per rank, read from a torch.profiler
Chrome trace (CPU) or from ``nsys stats --report nvtx_pushpop_trace`` (CUDA).
Only ranges inside the ``measure`` window count; ``capture[<cap>]`` ranges
outside it are reported apart (a one-time cost, not part of a forward).

Per range name: calls per rank, the mean over ranks of each rank's total, the
mean per call, the share of the forward (the ``prefill`` range), and the
slowest rank with every rank's total - CP load imbalance shows up there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from graphcp.nvtx_ranges import PREFIX, RANGES, family, index

SCHEMA = 1
FORWARD = "prefill"
WINDOW = "measure"


@dataclass(frozen=True)
class RangeEvent:
    name: str  # without the "graphcp:" prefix
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class RangeStat:
    count: int = 0
    total_ms: float = 0.0


@dataclass
class RankProfile:
    rank: int
    ranges: dict[str, RangeStat] = field(default_factory=dict)
    captures_ms: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "rank": self.rank, "ranges": {k: asdict(v) for k, v in self.ranges.items()},
                "captures_ms": self.captures_ms, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "RankProfile":
        return cls(d["rank"], {k: RangeStat(**v) for k, v in d["ranges"].items()}, d.get("captures_ms", {}),
                   d.get("meta", {}))


# ---- reading events -------------------------------------------------------------------
def events_from_chrome_trace(path: str | Path) -> list[RangeEvent]:
    """The ``graphcp:*`` complete events of a torch.profiler Chrome trace."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read Chrome trace {path}: {e}") from e
    out = []
    for ev in trace.get("traceEvents", []):
        name = ev.get("name", "")
        if ev.get("ph") == "X" and name.startswith(PREFIX):
            out.append(RangeEvent(name[len(PREFIX):], float(ev["ts"]), float(ev.get("dur", 0.0))))
    return out


def split_window(events: list[RangeEvent]) -> tuple[list[RangeEvent], list[RangeEvent]]:
    """(events inside a ``measure`` range, ``capture[*]`` events outside every one).
    No ``measure`` range at all: everything counts (a trace of the window alone)."""
    windows = [(e.start_us, e.end_us) for e in events if e.name == WINDOW]
    if not windows:
        return events, []
    inside, captures = [], []
    for e in events:
        if any(lo <= e.start_us and e.end_us <= hi for lo, hi in windows):
            inside.append(e)
        elif family(e.name) == "capture":
            captures.append(e)
    return inside, captures


def rank_profile(rank: int, events: list[RangeEvent], captures_ms: dict[str, float] | None = None,
                 meta: dict | None = None) -> RankProfile:
    inside, captures = split_window(events)
    rp = RankProfile(rank, meta=dict(meta or {}))
    for e in inside:
        st = rp.ranges.setdefault(e.name, RangeStat())
        st.count += 1
        st.total_ms += e.dur_us / 1e3
    for e in captures:
        rp.captures_ms[e.name] = rp.captures_ms.get(e.name, 0.0) + e.dur_us / 1e3
    for name, ms in (captures_ms or {}).items():
        rp.captures_ms.setdefault(name, ms)
    return rp


# ---- merging ranks ----------------------------------------------------------------------
def sort_key(name: str) -> tuple:
    """Scheme order (RANGES), then the index numerically: layer[2] before layer[10]."""
    fams = list(RANGES)
    f = family(name)
    i = index(name)
    return (fams.index(f) if f in fams else len(fams), f, -1 if i is None else i, name)


def _row(name: str, per_rank: list[RangeStat], forward_ms: float) -> dict:
    totals = [s.total_ms for s in per_rank]
    counts = [s.count for s in per_rank]
    mean_total = sum(totals) / len(totals)
    slowest = max(range(len(totals)), key=totals.__getitem__)
    calls = max(counts)
    kind = RANGES.get(family(name))
    return {
        "name": name,
        "category": kind.category if kind else "",
        "count": calls,  # calls per rank (every rank runs the same forwards)
        "counts": counts,
        "total_ms": mean_total,  # mean over ranks of the rank's total
        "mean_ms": mean_total / calls if calls else 0.0,
        "share": mean_total / forward_ms if forward_ms > 0 else None,
        "slowest_rank": slowest,
        "slowest_total_ms": totals[slowest],
        "imbalance": totals[slowest] / mean_total if mean_total > 0 else 1.0,
        "per_rank_total_ms": totals,
    }


def _family_stats(rp: RankProfile) -> dict[str, RangeStat]:
    out: dict[str, RangeStat] = {}
    for name, st in rp.ranges.items():
        key = family(name) + ("[*]" if index(name) is not None else "")
        agg = out.setdefault(key, RangeStat())
        agg.count += st.count
        agg.total_ms += st.total_ms
    return out


def merge(ranks: list[RankProfile], config: dict | None = None) -> dict:
    """The summary.json of a run: every rank's ranges side by side."""
    if not ranks:
        raise ValueError("no rank profiles to merge")
    ranks = sorted(ranks, key=lambda r: r.rank)

    def table(stats: list[dict[str, RangeStat]]) -> list[dict]:
        names = sorted({n for s in stats for n in s}, key=sort_key)
        fwd = [s.get(FORWARD, RangeStat()).total_ms for s in stats]
        forward_ms = sum(fwd) / len(fwd)
        return [_row(n, [s.get(n, RangeStat()) for s in stats], forward_ms) for n in names]

    per_range = [r.ranges for r in ranks]
    fwd = [r.ranges.get(FORWARD, RangeStat()) for r in ranks]
    caps = sorted({c for r in ranks for c in r.captures_ms}, key=sort_key)
    return {
        "schema": SCHEMA,
        "config": dict(config or {}),
        "ranks": [r.rank for r in ranks],
        "forward": {"name": FORWARD, "count": max(s.count for s in fwd),
                    "total_ms": sum(s.total_ms for s in fwd) / len(fwd),
                    "per_rank_total_ms": [s.total_ms for s in fwd]},
        "families": table([_family_stats(r) for r in ranks]),
        "ranges": table(per_range),
        "captures": [{"name": c, "per_rank_ms": [r.captures_ms.get(c, 0.0) for r in ranks]} for c in caps],
        "rank_meta": [r.meta for r in ranks],
    }


# ---- writing ----------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _table(rows: list[dict]) -> list[str]:
    head = ("| range | category | calls/rank | total ms | mean ms | share of forward | slowest rank | "
            "imbalance | per-rank total ms |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        share = "-" if r["share"] is None else f"{100 * r['share']:.1f}%"
        per_rank = " / ".join(_ms(t) for t in r["per_rank_total_ms"])
        out.append(f"| `{r['name']}` | {r['category']} | {r['count']} | {_ms(r['total_ms'])} | {_ms(r['mean_ms'])} | "
                   f"{share} | {r['slowest_rank']} ({_ms(r['slowest_total_ms'])}) | {r['imbalance']:.2f} | "
                   f"{per_rank} |")
    return out


def render_markdown(summary: dict) -> str:
    cfg = summary["config"]
    fwd = summary["forward"]
    lines = [f"# graphcp profile: {cfg.get('label', 'run')}", ""]
    if cfg:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in cfg.items() if k != "label"]
        lines.append("")
    lines += [
        f"Forward (`{fwd['name']}`): {fwd['count']} calls per rank, {_ms(fwd['total_ms'])} ms per rank "
        f"(mean over ranks; per rank {' / '.join(_ms(t) for t in fwd['per_rank_total_ms'])} ms).",
        "",
        "Times are each rank's time inside the range, averaged over ranks; ranges nest (`layer[i]` holds",
        "`kv_exchange[i]` and `attention[i]`), so shares do not add up to 100%. `slowest rank` is the rank",
        "with the largest total, `imbalance` its total over the mean. See profiles/README.md.",
        "",
        "## By family",
        "",
        *_table(summary["families"]),
        "",
        "## By range",
        "",
        *_table(summary["ranges"]),
        "",
    ]
    if summary["captures"]:
        lines += ["## Capture (one-time cost per bucket, not part of a forward)", "",
                  "| range | per-rank ms |", "|---|---|"]
        lines += [f"| `{c['name']}` | {' / '.join(_ms(t) for t in c['per_rank_ms'])} |" for c in summary["captures"]]
        lines.append("")
    return "\n".join(lines)


def write_rank(out_dir: str | Path, rp: RankProfile) -> Path:
    p = Path(out_dir) / f"summary_rank{rp.rank}.json"
    p.write_text(json.dumps(rp.to_json(), indent=1) + "\n")
    return p


def write_summary(out_dir: str | Path, summary: dict) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "summary.json", out / "summary.md"
    j.write_text(json.dumps(summary, indent=1) + "\n")
    m.write_text(render_markdown(summary))
    return j, m
