"""Evaluate bucket sets on a workload and render the comparison (Markdown, JSON, PNG).

Every number comes from ``select_many``, a vectorised copy of ``BucketSet.select``
(smallest capacity >= required; eager when none fits or capacity > F * required,
F compared against the raw rows). The tests check it against ``select`` batch by
batch.

Metrics of a set on a workload (r = largest rank's raw rows of a batch):
- padding: padded rows of graph batches, sum(c - r), over the real rows sum(r) of
  all batches; also as mean padded rows per batch;
- eager: share of batches that run eagerly (too large / padding over the factor);
- overhead: the optimiser's objective, cost / real rows - 1, where a graph batch
  costs c rows and an eager one ``eager_penalty * r`` (see optimise.py). This is
  the column the tuned set is best at, by construction.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from graphcp.runtime.capture.buckets import FALLBACK_PADDING, FALLBACK_TOO_LARGE, BucketSet
from graphcp.tune.optimise import CostModel, TuneResult, optimise

_REASON = {0: None, 1: FALLBACK_TOO_LARGE, 2: FALLBACK_PADDING}


def select_many(bucket_set: BucketSet, required: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ``BucketSet.select``: (capacity per batch, 0 where eager; reason code 0/1/2)."""
    required = np.asarray(required, dtype=np.int64)
    if required.size and required.min() < 1:
        raise ValueError(f"required rows must be >= 1, got {int(required.min())}")
    caps = np.asarray(bucket_set.capacities, dtype=np.int64)
    i = np.searchsorted(caps, required, side="left")
    too_large = i == len(caps)
    cap = caps[np.minimum(i, len(caps) - 1)]
    over = ~too_large & (cap > bucket_set.padding_factor * required)
    reason = np.where(too_large, 1, np.where(over, 2, 0))
    return np.where(reason == 0, cap, 0), reason


@dataclass(frozen=True)
class Evaluation:
    name: str
    capacities: tuple[int, ...]
    n_batches: int
    real_rows: int  # sum of raw required rows over all batches
    padded_rows: int  # sum of (capacity - required) over graph batches
    eager_too_large: int  # batches larger than every bucket
    eager_padding: int  # batches a bucket holds, but padded past the factor
    eager_rows: int
    cost: float  # row-equivalents: graph batches c, eager batches penalty * r
    measured: list[dict] | None = None  # per-bucket capture_s / pool_bytes, when measured

    @property
    def k(self) -> int:
        return len(self.capacities)

    @property
    def eager_batches(self) -> int:
        return self.eager_too_large + self.eager_padding

    @property
    def padding_waste(self) -> float:
        return self.padded_rows / self.real_rows

    @property
    def mean_padded_rows(self) -> float:
        return self.padded_rows / self.n_batches

    @property
    def eager_rate(self) -> float:
        return self.eager_batches / self.n_batches

    @property
    def overhead(self) -> float:
        return self.cost / self.real_rows - 1.0

    def capture_s(self) -> float | None:
        return None if not self.measured else float(sum(m["capture_s"] for m in self.measured))

    def pool_bytes(self) -> int | None:
        # all buckets share one pool, so the pool is the largest figure, not the sum
        return None if not self.measured else int(max(m["pool_bytes"] for m in self.measured))

    def to_json(self) -> dict:
        d = asdict(self)
        d["capacities"] = list(self.capacities)
        d.update(
            k=self.k,
            eager_batches=self.eager_batches,
            padding_waste=self.padding_waste,
            mean_padded_rows=self.mean_padded_rows,
            eager_rate=self.eager_rate,
            overhead=self.overhead,
            capture_s=self.capture_s(),
            pool_bytes=self.pool_bytes(),
        )
        return d


def evaluate(
    bucket_set: BucketSet, required: np.ndarray, eager_penalty: float | None = None, name: str = "set"
) -> Evaluation:
    required = np.asarray(required, dtype=np.int64)
    pen = bucket_set.padding_factor if eager_penalty is None else float(eager_penalty)
    cap, reason = select_many(bucket_set, required)
    graph = reason == 0
    eager_rows = int(required[~graph].sum())
    return Evaluation(
        name=name,
        capacities=bucket_set.capacities,
        n_batches=int(required.size),
        real_rows=int(required.sum()),
        padded_rows=int((cap[graph] - required[graph]).sum()),
        eager_too_large=int((reason == 1).sum()),
        eager_padding=int((reason == 2).sum()),
        eager_rows=eager_rows,
        cost=float(cap[graph].sum()) + pen * eager_rows,
    )


@dataclass
class Report:
    settings: dict  # cp_size, layout, align, padding_factor, eager_penalty, bucket_cost, max_capacity
    workload: dict  # Workload.summary()
    tuned: Evaluation
    rows: list[Evaluation]  # tuned first, then per baseline: baseline, tuned at its bucket count
    pareto: list[dict]  # k, capacities, overhead (comparison DP, capacities up to pareto_max_capacity)
    pareto_max_capacity: int | None
    over_max_capacity: int  # batches whose aligned requirement exceeds max_capacity (always eager)
    required: np.ndarray = field(repr=False)  # raw required rows per batch, for the plot
    per_bucket: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "settings": self.settings,
            "workload": self.workload,
            "tuned": self.tuned.to_json(),
            "rows": [r.to_json() for r in self.rows],
            "pareto": self.pareto,
            "pareto_max_capacity": self.pareto_max_capacity,
            "over_max_capacity": self.over_max_capacity,
            "over_max_capacity_share": self.over_max_capacity / self.tuned.n_batches,
            "per_bucket": self.per_bucket,
        }

    def write_json(self, path: str | Path) -> None:
        plain = lambda o: o.item() if isinstance(o, np.generic) else str(o)  # noqa: E731
        Path(path).write_text(json.dumps(self.to_json(), indent=2, default=plain) + "\n")

    # ---- text ---------------------------------------------------------------------
    def markdown(self) -> str:
        s, w = self.settings, self.workload
        measured = any(r.measured for r in self.rows)
        out = [
            f"workload {w['name']}: {w['batches']} batches, {w['requests']} requests, "
            f"{w['tokens']} tokens; cp_size={s['cp_size']} layout={s['layout']} align={s['align']} "
            f"padding_factor={s['padding_factor']} eager_penalty={s['eager_penalty']}"
            + (f" bucket_cost={s['bucket_cost']}" if s.get("bucket_cost") else ""),
            "",
        ]
        head = ["set", "buckets", "largest", "overhead %", "padding %", "padded rows/batch", "eager %"]
        if measured:
            head += ["capture s", "pool MiB"]
        if len(self.rows) > 1:  # a schedule of more buckets pads less: compare at equal counts first
            out += ["each schedule, then the best set of as many buckets (tuned@k); last, the set written "
                    f"(tuned, {self.tuned.k} buckets: --max-buckets)", ""]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for r in self.rows[1:] + self.rows[:1]:
            cells = [
                r.name,
                str(r.k),
                str(r.capacities[-1]) if r.capacities else "-",
                f"{100 * r.overhead:.2f}",
                f"{100 * r.padding_waste:.2f}",
                f"{r.mean_padded_rows:.1f}",
                f"{100 * r.eager_rate:.2f}",
            ]
            if measured:
                cells += [
                    f"{r.capture_s():.2f}" if r.measured else "-",
                    f"{r.pool_bytes() / 2**20:.1f}" if r.measured else "-",
                ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.append(f"tuned capacities (local rows): {list(self.tuned.capacities)}")
        if self.over_max_capacity:
            share = 100 * self.over_max_capacity / self.tuned.n_batches
            out.append(
                f"{self.over_max_capacity} batches ({share:.2f}%) need more than --max-capacity="
                f"{s['max_capacity']} rows and run eagerly with any bucket set"
            )
        if self.pareto_max_capacity != s.get("max_capacity"):
            out.append(
                f"(tuned@k rows may use capacities up to {self.pareto_max_capacity}, the largest baseline bucket)"
            )
        if self.per_bucket:
            out += ["", self._per_bucket_table()]
        return "\n".join(out)

    def _per_bucket_table(self) -> str:
        measured = any("capture_s" in b for b in self.per_bucket)
        head = ["capacity", "batches %", "padding %"] + (["capture s", "pool MiB"] if measured else [])
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
        for b in self.per_bucket:
            cells = [str(b["capacity"]), f"{100 * b['batch_share']:.2f}", f"{100 * b['padding']:.2f}"]
            if measured:
                cells += [
                    f"{b['capture_s']:.3f}" if "capture_s" in b else "-",
                    f"{b['pool_bytes'] / 2**20:.1f}" if "pool_bytes" in b else "-",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    # ---- plot ---------------------------------------------------------------------
    def plot(self, path: str | Path) -> None:
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def figure(self):
        """Left, the histogram of required rows with the tuned buckets behind it (dotted
        lines, and ticks above the axes): a spike at a bucket stays visible. Right, the
        cost for every bucket count."""
        import matplotlib  # lazy: the runtime never needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        req = self.required
        ax1.hist(req, bins=min(200, max(10, len(np.unique(req)))), color="0.45", zorder=2)
        ax1.set_yscale("log")  # chunked workloads pile most batches into one bin
        top = ax1.get_xaxis_transform()  # x in data, y in axes fractions: a tick above the plot
        for i, c in enumerate(self.tuned.capacities):
            ax1.axvline(c, color="tab:red", lw=0.8, ls=":", alpha=0.8, zorder=1,
                        label="tuned buckets" if i == 0 else None)
            ax1.plot([c], [1.0], marker="v", ms=7, color="tab:red", transform=top, clip_on=False, zorder=3)
        if self.settings.get("max_capacity") and self.over_max_capacity:
            ax1.axvline(self.settings["max_capacity"], color="k", ls="--", lw=1, zorder=1, label="max capacity")
        ax1.set_xlabel("required local rows (largest rank)")
        ax1.set_ylabel("batches")
        ax1.set_title(f"{self.workload['name']}: cp={self.settings['cp_size']} {self.settings['layout']}")
        ax1.legend(loc="upper left")

        ks = [p["k"] for p in self.pareto]
        ax2.plot(
            ks, [100 * p["overhead"] for p in self.pareto], "o-", ms=3, color="tab:red", label="tuned (optimal for k)"
        )
        ax2.plot(
            [self.tuned.k], [100 * self.tuned.overhead], "*", ms=14, color="tab:red", label=f"tuned ({self.tuned.k})"
        )
        for r in self.rows:
            if r.name in self.settings.get("baselines", []):
                ax2.plot([r.k], [100 * r.overhead], "s", ms=7, label=f"{r.name} ({r.k})")
        ax2.set_xscale("log")
        ax2.set_yscale("symlog", linthresh=1.0)  # baselines that run eagerly sit near 100%
        shown = [100 * p["overhead"] for p in self.pareto] + [100 * r.overhead for r in self.rows]
        top = max(shown + [1.0])
        # start at the smallest cost shown, not 0: symlog would label a stray "0" at the bottom
        ax2.set_ylim(min([x for x in shown if x > 0] + [1.0]) / 2, top * 1.6)
        ax2.set_xlabel("buckets (k)")
        ax2.set_ylabel("overhead % (padding + eager penalty)")
        ax2.set_title("cost vs bucket count")
        ax2.grid(True, which="both", alpha=0.3)
        ax2.legend()
        fig.tight_layout()
        return fig


def per_bucket_stats(bucket_set: BucketSet, required: np.ndarray, measured: list[dict] | None = None) -> list[dict]:
    cap, _ = select_many(bucket_set, required)
    by_cap = {int(m["capacity"]): m for m in (measured or [])}
    out = []
    for c in bucket_set.capacities:
        hit = cap == c
        real = int(required[hit].sum())
        row = {
            "capacity": c,
            "batches": int(hit.sum()),
            "batch_share": float(hit.mean()),
            "padding": (int(hit.sum()) * c - real) / real if real else 0.0,
        }
        if c in by_cap:
            row.update(capture_s=float(by_cap[c]["capture_s"]), pool_bytes=int(by_cap[c]["pool_bytes"]))
        out.append(row)
    return out


def build_report(
    required: np.ndarray,
    tuned: TuneResult,
    tuned_set: BucketSet,
    baselines: dict[str, BucketSet],
    settings: dict,
    workload: dict,
    measured: list[dict] | None = None,
) -> Report:
    """Tuned set vs each baseline, and vs the optimal set with the baseline's bucket count."""
    model: CostModel = tuned.model
    pen = model.penalty
    tuned_eval = evaluate(tuned_set, required, pen, "tuned")
    if measured:
        tuned_eval = replace(tuned_eval, measured=measured)
    # one DP covers every k in the table and the plot; it may use capacities up to the
    # largest baseline bucket, so a baseline is never compared with a smaller search space
    cap = tuned.max_capacity
    cmp_cap = None if cap is None else max([cap] + [b.largest for b in baselines.values()])
    k_cmp = max(
        [len(tuned.pareto) or 1, settings.get("max_buckets", 1)] + [len(b.capacities) for b in baselines.values()]
    )
    curve = optimise(required, k_cmp, tuned.align, cmp_cap, CostModel(model.padding_factor, model.eager_penalty))
    rows = [tuned_eval]
    for name, bs in baselines.items():
        rows.append(evaluate(bs, required, pen, name))
        if curve.pareto:
            best = curve.best(len(bs.capacities))
            same = BucketSet(best.capacities, tuned.align, model.padding_factor)
            rows.append(evaluate(same, required, pen, f"tuned@{len(bs.capacities)} (vs {name})"))
    pareto = [
        {"k": p.k, "capacities": list(p.capacities), "overhead": p.cost / tuned.real_rows - 1.0} for p in curve.pareto
    ]
    over = 0 if cap is None else int((-(-required // tuned.align) * tuned.align > cap).sum())
    return Report(
        settings={**settings, "eager_penalty": pen, "baselines": list(baselines)},
        workload=workload,
        tuned=tuned_eval,
        rows=rows,
        pareto=pareto,
        pareto_max_capacity=cmp_cap,
        over_max_capacity=over,
        required=np.asarray(required),
        per_bucket=per_bucket_stats(tuned_set, np.asarray(required), measured),
    )
