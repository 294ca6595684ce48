"""Workloads for bucket tuning: batches of (extend, prefix) lengths.

A workload is a sequence of prefill forwards. Each batch is a list of requests with
an extend length (new tokens, >= 1) and a prefix length (tokens already cached,
>= 0). 100k batches are held as flat numpy arrays plus batch offsets, so the
required-rows arithmetic runs vectorised over the whole workload.

Sources:
- JSONL, one batch a line: ``{"extend": [ints], "prefix": [ints]}`` (prefix
  optional, all zeros when absent). Blank lines are skipped.
- synthetic generators named by a spec string ``NAME[:k=v,k=v]`` (see
  ``GENERATORS`` for the names, parameters and their defaults).

Generate a file: ``python -m graphcp.tune.workload longctx:batches=1000 --seed 0 -o w.jsonl``
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from graphcp.checks import MAX_TOKENS, check_float, check_int
from graphcp.errors import InputError
from graphcp.jsonl import WORKLOAD, other_format, read_jsonl, wrong_line

#: a request's extend or prefix length: far above any context, and small enough that
#: no per-batch or per-workload sum can overflow int64
MAX_LENGTH = MAX_TOKENS
#: synthetic workloads: at most this many batches, and this many requests expected in all
MAX_SYNTHETIC_BATCHES = 1_000_000
MAX_SYNTHETIC_REQUESTS = 10_000_000


class WorkloadError(InputError):
    """A workload file or spec is malformed; the message names where and why."""


@dataclass(frozen=True)
class Workload:
    extend: np.ndarray  # int64, every request's extend length, batch after batch
    prefix: np.ndarray  # int64, same shape: cached prefix of each request
    offsets: np.ndarray  # int64, n_batches + 1: batch b is requests offsets[b]:offsets[b+1]
    name: str = "workload"
    source: dict = field(default_factory=dict, compare=False)  # how it was made (file, spec, seed)

    def __post_init__(self) -> None:
        if self.extend.shape != self.prefix.shape or self.extend.ndim != 1:
            raise WorkloadError(f"extend {self.extend.shape} and prefix {self.prefix.shape} must be equal 1-D shapes")
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.extend):
            raise WorkloadError("offsets must run from 0 to the number of requests")
        if len(self.offsets) < 2:
            raise WorkloadError("a workload needs at least one batch")
        if np.any(np.diff(self.offsets) < 1):
            raise WorkloadError("every batch needs at least one request")
        for name in ("extend", "prefix", "offsets"):
            if getattr(self, name).dtype.kind not in "iu":
                raise WorkloadError(f"{name} must hold integers, got dtype {getattr(self, name).dtype}")
        if np.any(self.extend < 1):
            raise WorkloadError(f"extend lengths must be >= 1, got {int(self.extend.min())}")
        if np.any(self.prefix < 0):
            raise WorkloadError(f"prefix lengths must be >= 0, got {int(self.prefix.min())}")
        for name in ("extend", "prefix"):
            arr = getattr(self, name)
            if arr.size and int(arr.max()) > MAX_LENGTH:
                raise WorkloadError(f"{name} lengths must be <= {MAX_LENGTH}, got {int(arr.max())}")

    @property
    def n_batches(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_requests(self) -> int:
        return len(self.extend)

    def batch(self, b: int) -> tuple[list[int], list[int]]:
        lo, hi = int(self.offsets[b]), int(self.offsets[b + 1])
        return self.extend[lo:hi].tolist(), self.prefix[lo:hi].tolist()

    def batch_tokens(self) -> np.ndarray:
        """New tokens per batch (the T that is split across ranks)."""
        return np.add.reduceat(self.extend, self.offsets[:-1])

    def summary(self) -> dict:
        t = self.batch_tokens()
        reqs = np.diff(self.offsets)
        return {
            "name": self.name,
            **self.source,
            "batches": self.n_batches,
            "requests": self.n_requests,
            "tokens": int(t.sum()),
            "tokens_per_batch": {
                "min": int(t.min()),
                "p50": float(np.percentile(t, 50)),
                "p90": float(np.percentile(t, 90)),
                "max": int(t.max()),
                "mean": float(t.mean()),
            },
            "requests_per_batch_mean": float(reqs.mean()),
            "prefix_tokens": int(self.prefix.sum()),
        }

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_batches(
        cls,
        batches: Iterable[tuple[Sequence[int], Sequence[int] | None]],
        name: str = "workload",
        source: dict | None = None,
    ) -> "Workload":
        ext: list[int] = []
        pre: list[int] = []
        offs = [0]
        for e, p in batches:
            ext.extend(e)
            pre.extend(p if p is not None else [0] * len(e))
            offs.append(len(ext))
        return cls(
            np.asarray(ext, dtype=np.int64),
            np.asarray(pre, dtype=np.int64),
            np.asarray(offs, dtype=np.int64),
            name,
            source or {},
        )

    def save_jsonl(self, path: str | Path) -> None:
        lines = []
        for b in range(self.n_batches):
            e, p = self.batch(b)
            # prefix only when some request has one: keeps shipped files small
            lines.append(json.dumps({"extend": e, "prefix": p} if any(p) else {"extend": e}, separators=(",", ":")))
        Path(path).write_text("\n".join(lines) + "\n")


# ---- JSONL ------------------------------------------------------------------------
def _int_list(value, key: str, where: str, minimum: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise WorkloadError(f"{where}: {key!r} must be a non-empty list of integers, got {value!r}"[:300])
    for v in value:
        # bool is an int subclass; true/false are not lengths
        if isinstance(v, bool) or not isinstance(v, int):
            raise WorkloadError(f"{where}: {key!r} must hold integers, got {v!r}"[:300])
        if v < minimum:
            what = "positive" if minimum == 1 else "non-negative"
            raise WorkloadError(f"{where}: {key!r} lengths must be {what} (>= {minimum}), got {v}")
        if v > MAX_LENGTH:  # past int64 once summed or converted: refused here, not overflowed later
            raise WorkloadError(f"{where}: {key!r} lengths must be <= {MAX_LENGTH}, got {v}")
    return value


def parse_batch_line(line: str, where: str) -> tuple[list[int], list[int]]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f'{where}: not valid JSON ({e.msg}); expected {{"extend": [...], "prefix": [...]}}') from e
    return parse_batch(obj, where)


def parse_batch(obj, where: str) -> tuple[list[int], list[int]]:
    """One batch from its parsed JSON line (``where`` names the file and line)."""
    if not isinstance(obj, dict):
        raise WorkloadError(
            f"{where}: expected a JSON object with 'extend' (and optional 'prefix'), got {type(obj).__name__}"
        )
    if other_format(obj, (WORKLOAD,)) is not None:  # a request file, a conversation: say which
        raise WorkloadError(wrong_line(where, obj, (WORKLOAD,)))
    if "extend" not in obj:
        raise WorkloadError(f"{where}: missing 'extend' (a list of new-token counts per request)")
    unknown = set(obj) - {"extend", "prefix"}
    if unknown:
        raise WorkloadError(f"{where}: unknown keys {sorted(unknown)}; expected 'extend' and optional 'prefix'")
    ext = _int_list(obj["extend"], "extend", where, 1)
    if "prefix" not in obj:
        return ext, [0] * len(ext)
    pre = _int_list(obj["prefix"], "prefix", where, 0)
    if len(pre) != len(ext):
        raise WorkloadError(
            f"{where}: 'prefix' has {len(pre)} entries but 'extend' has {len(ext)}; expected one per request"
        )
    return ext, pre


def load_jsonl(path: str | Path) -> Workload:
    p = Path(path)
    batches = [parse_batch(obj, where) for where, obj in read_jsonl(p, WorkloadError, "workload file")]
    if not batches:
        raise WorkloadError(f"workload file {p} has no batches")
    return Workload.from_batches(batches, name=p.stem, source={"file": str(p)})


# ---- synthetic generators -----------------------------------------------------------
def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(np.int64)


def gen_longctx(
    rng: np.random.Generator, batches: int, budget: int, median: float, sigma: float, max_len: int, load: float
):
    """Long-context serving under chunked prefill: log-normal request lengths arrive
    (Poisson, ``load`` x budget tokens per step on average) and each step packs the
    queue into one batch of at most ``budget`` tokens. A request that does not fit is
    split: the rest waits for the next step and carries the tokens already done as
    its prefix. Steps with an empty queue emit nothing."""
    mean_len = median * np.exp(sigma**2 / 2)
    rate = load * budget / mean_len
    queue: list[list[int]] = []  # [remaining, done]
    out = []
    while len(out) < batches:
        for length in _lognormal_lengths(rng, rng.poisson(rate), median, sigma, 1, max_len):
            queue.append([int(length), 0])
        left, ext, pre = budget, [], []
        while queue and left > 0:
            req = queue[0]
            take = min(req[0], left)
            ext.append(take)
            pre.append(req[1])
            req[0] -= take
            req[1] += take
            left -= take
            if req[0] == 0:
                queue.pop(0)
        if ext:
            out.append((ext, pre))
    return out


def gen_chunked(rng: np.random.Generator, batches: int, chunk: int, median: float, sigma: float, max_len: int):
    """A fixed-chunk stream: one request at a time cut into ``chunk``-token pieces,
    one piece a batch. Most batches are exactly ``chunk`` tokens; each request's
    tail is smaller. Later pieces carry the earlier ones as prefix."""
    out = []
    while len(out) < batches:
        length = int(_lognormal_lengths(rng, 1, median, sigma, 1, max_len)[0])
        for start in range(0, length, chunk):
            out.append(([min(chunk, length - start)], [start]))
    return out[:batches]


def gen_short(
    rng: np.random.Generator, batches: int, reqs: float, median: float, sigma: float, max_len: int, hit: float
):
    """Short prompts (chat, tool calls): 1 + Poisson(reqs - 1) requests a batch,
    log-normal lengths of tens to hundreds of tokens; a fraction ``hit`` of the
    requests reuse a cached prefix (system prompt / earlier turns)."""
    n_req = 1 + rng.poisson(max(reqs - 1.0, 0.0), batches)
    total = int(n_req.sum())
    ext = _lognormal_lengths(rng, total, median, sigma, 1, max_len)
    pre = np.where(rng.random(total) < hit, _lognormal_lengths(rng, total, 512, 0.7, 1, 32768), 0)
    offs = np.concatenate([[0], np.cumsum(n_req)])
    return ext, pre, offs


@dataclass(frozen=True)
class Generator:
    fn: Callable
    defaults: dict  # parameter -> default (its type is the parameter's type)
    help: str


GENERATORS: dict[str, Generator] = {
    "longctx": Generator(
        gen_longctx,
        dict(batches=1000, budget=8192, median=4096.0, sigma=1.0, max_len=131072, load=0.7),
        "log-normal long requests packed into a token budget per batch (chunked prefill, later chunks carry a prefix)",
    ),
    "chunked": Generator(
        gen_chunked,
        dict(batches=1000, chunk=8192, median=24576.0, sigma=1.0, max_len=262144),
        "fixed-chunk stream: most batches exactly `chunk` tokens, each request's tail smaller",
    ),
    "short": Generator(
        gen_short,
        dict(batches=2000, reqs=8.0, median=120.0, sigma=0.8, max_len=4096, hit=0.3),
        "short-prompt mix: ~`reqs` requests a batch of tens to hundreds of tokens",
    ),
}


def parse_spec(spec: str) -> tuple[str, dict]:
    """``NAME[:k=v,...]`` -> (name, params with defaults filled in; ``seed`` kept apart)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in GENERATORS:
        raise WorkloadError(f"unknown synthetic workload {name!r}; expected one of {sorted(GENERATORS)}")
    defaults = GENERATORS[name].defaults
    params = dict(defaults)
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise WorkloadError(f"synthetic spec {spec!r}: {item!r} is not key=value")
        if key == "seed":
            params["seed"] = _parse_number(spec, key, raw, int)
            continue
        if key not in defaults:
            raise WorkloadError(
                f"synthetic spec {spec!r}: unknown parameter {key!r} for {name}; "
                f"expected one of {sorted(defaults)} or seed"
            )
        params[key] = _parse_number(spec, key, raw, type(defaults[key]))
    for key, value in params.items():
        lo, hi, lo_open = _RANGES[key]
        # NaN and inf fail every comparison: refused by name, not let through
        check = check_float if isinstance(value, float) else check_int
        kw = {"lo_open": lo_open} if check is check_float else {}
        check(value, key, lo=lo, hi=hi, where=f"synthetic spec {spec!r}", err=WorkloadError, **kw)
    expected = params["batches"] * _requests_per_batch(name, params)
    if expected > MAX_SYNTHETIC_REQUESTS:
        raise WorkloadError(f"synthetic spec {spec!r}: about {expected:.3g} requests in all; expected at most "
                            f"{MAX_SYNTHETIC_REQUESTS} (fewer batches, or longer requests)")
    return name, params


#: parameter -> (low, high, low excluded)
_RANGES = {
    "batches": (1, MAX_SYNTHETIC_BATCHES, False), "budget": (1, MAX_LENGTH, False), "chunk": (1, MAX_LENGTH, False),
    "max_len": (1, MAX_LENGTH, False), "median": (0.0, float(MAX_LENGTH), True), "sigma": (0.0, 10.0, False),
    "load": (0.0, 100.0, True), "reqs": (0.0, 65536.0, True), "hit": (0.0, 1.0, False), "seed": (0, 2**63 - 1, False),
}


def _requests_per_batch(name: str, params: dict) -> float:
    if name == "longctx":  # Poisson arrivals of load x budget tokens a step, of mean length median e^(s^2/2)
        return max(1.0, params["load"] * params["budget"] / (params["median"] * math.exp(params["sigma"] ** 2 / 2)))
    return params.get("reqs", 1.0)


def _parse_number(spec: str, key: str, raw: str, typ: type):
    try:
        if len(raw.strip()) > 40:
            raise ValueError(raw)
        return typ(raw) if typ is float else int(raw)
    except ValueError:
        raise WorkloadError(f"synthetic spec {spec!r}: {key}={raw!r} is not a valid {typ.__name__}") from None


def synthetic(spec: str, seed: int = 0) -> Workload:
    """Generate a workload from ``NAME[:k=v,...]``; a ``seed=`` in the spec wins over ``seed``."""
    name, params = parse_spec(spec)
    seed = params.pop("seed", seed)
    rng = np.random.default_rng(seed)
    made = GENERATORS[name].fn(rng, **params)
    source = {"synthetic": spec, "seed": seed}
    if isinstance(made, tuple):  # already flat arrays
        ext, pre, offs = made
        return Workload(ext.astype(np.int64), pre.astype(np.int64), offs.astype(np.int64), name, source)
    return Workload.from_batches(made, name=name, source=source)


def load_workload(path: str | None = None, spec: str | None = None, seed: int = 0) -> Workload:
    if (path is None) == (spec is None):
        raise WorkloadError("give exactly one of a workload file or a synthetic spec")
    return load_jsonl(path) if path is not None else synthetic(spec, seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m graphcp.tune.workload", description="write a synthetic workload as JSONL"
    )
    ap.add_argument(
        "spec",
        help="NAME[:k=v,...], NAME one of "
        + ", ".join(f"{k} ({g.help}; defaults {g.defaults})" for k, g in GENERATORS.items()),
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    w = synthetic(args.spec, args.seed)
    w.save_jsonl(args.output)
    print(f"{args.output}: {w.n_batches} batches, {w.n_requests} requests, {int(w.extend.sum())} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
