"""Which options combine: the one declaration.

Every option a run is made of is an axis here (its values, its API and command-line
names), and every pair of values that graphcp refuses is one :class:`Refusal` with its
reason and what to use instead. Everything else combines. From this declaration come:

- the ``ConfigError`` a refused pair raises (:func:`check`, called by ``RuntimeConfig``
  with its own fields, by the engine once the model and the backend are known, and by
  the command line in the flags' names): one line naming both options and the reason;
- the README's table of refusals and ``docs/combinations.md`` (:func:`readme_table`,
  :func:`combinations_doc`; ``scripts/combinations_doc.py`` writes them, a test checks
  they match);
- the runs ``tests/test_combinations.py`` makes: a set of whole configurations that
  holds every allowed pair of values at least once (:func:`covering_runs`).

What a device can run (Triton on a CPU only in its interpreter, FlashInfer and trtllm
only on CUDA, a grouped matmul inside a CUDA graph) is not a combination of options:
those checks stay with the backends and the model, and the doc says which they are.
Plain Python: no torch (the command line checks flags before anything loads).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from typing import Mapping

from graphcp.errors import ConfigError
from graphcp.options import ATTENTION_BACKENDS, EXCHANGES, GRAPH_MODES, KV_CACHE_MODES, LAYOUTS, MOE_LAYOUTS


@dataclass(frozen=True)
class Axis:
    """One option a run is made of."""

    key: str
    values: tuple[str, ...]
    api: str  # how the Python API names it (the value follows as ``=value``)
    flag: str  # how the command line names it (the value follows after a space)
    #: the axis means something only when another axis has one of these values (the MoE
    #: layout of a dense model is ignored); None: always
    applies: tuple[str, tuple[str, ...]] | None = None

    def say(self, value: str, flags: bool, family: str | None = None) -> str:
        """The option set to ``value`` as the API or (``flags``) the command line names it
        (a command's own name for the flag where it renames it: :func:`flags_named`);
        ``family``: the model's (the model axis)."""
        flag = _FLAG_NAMES.get().get(self.key, self.flag)
        if self.key == "attn_tp":  # tp_size / (cp_size x dp_size)
            what, rel = ("attention TP > 1", ">") if value == ">1" else ("attention TP 1", "=")
            tp, split = (flag, "--cp x --dp") if flags else ("ParallelConfig.tp_size", "cp_size x dp_size")
            return f"{what} ({tp} {rel} {split})"
        if self.key in ("pp", "dp"):
            if value == ">1":
                return f"{flag} >1" if flags else f"{self.api} > 1"
            return f"{flag} {value}" if flags else f"{self.api}={value}"
        if self.key in ("aux", "export", "draft", "decode", "import"):
            return flag if flags else self.api
        if self.key == "model":
            kind = {"dsa": "DSA", "moe": "MoE", "dsv4": "DeepSeek V4", "hybrid": "linear-attention hybrid",
                    "kda": "KDA hybrid"}.get(value, "dense")
            return f"a {family} model ({kind})" if family else f"a {kind} model"
        return f"{flag} {value}" if flags else f"{self.api}={value!r}"


#: axis -> the flag a command names it by where it is not the axis's own (flags_named)
_FLAG_NAMES: ContextVar[Mapping[str, str]] = ContextVar("graphcp_flag_names", default={})


@contextmanager
def flags_named(names: Mapping[str, str]):
    """Within it, refusals name axis ``k`` by ``names[k]`` on the command line: a command
    that sets an axis under another flag (pd-demo's decode side: ``--decode-kv-cache``)."""
    token = _FLAG_NAMES.set({**_FLAG_NAMES.get(), **names})
    try:
        yield
    finally:
        _FLAG_NAMES.reset(token)


AXES: dict[str, Axis] = {a.key: a for a in (
    Axis("model", ("dense", "moe", "dsa", "dsv4", "hybrid", "kda"), "the model", "--model"),
    Axis("dtype", ("float32", "bfloat16"), "RuntimeConfig.dtype", "--dtype"),
    Axis("layout", LAYOUTS, "RuntimeConfig.layout", "--layout"),
    Axis("graph", GRAPH_MODES, "RuntimeConfig.graph", "--graph"),
    Axis("attention", tuple(a for a in ATTENTION_BACKENDS if a != "auto"), "RuntimeConfig.attention",
         "--attention"),
    Axis("kv_cache", KV_CACHE_MODES, "RuntimeConfig.kv_cache", "--kv-cache"),
    Axis("exchange", EXCHANGES, "RuntimeConfig.exchange", "--exchange"),
    Axis("moe", MOE_LAYOUTS, "RuntimeConfig.moe", "--moe",
         applies=("model", ("moe", "dsa", "dsv4", "hybrid", "kda"))),
    Axis("pp", ("1", ">1"), "ParallelConfig.pp_size", "--pp"),
    Axis("attn_tp", ("1", ">1"), "attention TP", "--tp"),
    Axis("dp", ("1", ">1"), "ParallelConfig.dp_size", "--dp"),
    Axis("aux", ("off", "on"), "RuntimeConfig.aux_hidden_layers", "--aux-hidden-layers"),
    Axis("export", ("off", "on"), "PrefillEngine.export_kv", "--export-kv"),
    Axis("draft", ("off", "on"), "RuntimeConfig.draft", "--draft"),  # an EAGLE-3 draft (docs/speculative.md)
    # decode steps after the prefill: PrefillEngine.decode / generate, `graphcp generate` (docs/decode.md)
    Axis("decode", ("off", "on"), "PrefillEngine.decode", "graphcp generate"),
    # a request's KV prefilled elsewhere, placed in this engine's cache (docs/pd.md, "Import")
    Axis("import", ("off", "on"), "PrefillEngine.import_kv", "--import-kv"),
)}

#: values that run only on a GPU (the matrix test runs the others on a CPU; the
#: backends' own tests run these through fakes that model the kernels)
GPU_ONLY: dict[str, tuple[str, ...]] = {"attention": ("flashinfer", "trtllm")}


@dataclass(frozen=True)
class Refusal:
    """Values of two axes that do not run together: ``a`` with ``b``, because ``reason``;
    ``instead``: (axis, value) alternatives the message suggests."""

    a: tuple[str, tuple[str, ...]]
    b: tuple[str, tuple[str, ...]]
    reason: str
    instead: tuple[tuple[str, str], ...]
    #: the README's few words
    short: str

    def matches(self, settings: Mapping[str, str]) -> bool:
        (ka, va), (kb, vb) = self.a, self.b
        return settings.get(ka) in va and settings.get(kb) in vb

    def message(self, settings: Mapping[str, str], flags: bool = False, family: str | None = None,
                names: Mapping[str, str] | None = None) -> str:
        """``names``: how to name an axis instead of its API name (the call that asked:
        ``{"decode": "PrefillEngine.generate"}``)."""
        (ka, _), (kb, _) = self.a, self.b

        def say(k: str) -> str:
            return (names or {}).get(k) or AXES[k].say(settings[k], flags, family)

        return f"{say(ka)} with {say(kb)}: {self.reason}; {self.advice(flags)}"

    def advice(self, flags: bool) -> str:
        """What to do instead: use the alternatives, or leave out an option turned on
        (``drop --draft``: ``use --draft`` would say the opposite)."""
        use = [AXES[k].say(v, flags) for k, v in self.instead if not _off(k, v)]
        drop = [AXES[k].say("on", flags) for k, v in self.instead if _off(k, v)]
        parts = [f"use {' or '.join(use)}"] if use else []
        return " or ".join(parts + [f"drop {d}" if flags else f"leave {d} unset" for d in drop])


def _off(key: str, value: str) -> bool:
    """An on/off option turned off (an option left out)."""
    return AXES[key].values == ("off", "on") and value == "off"


_RINGS = ("pass-kv", "pass-q")
#: the KDA hybrids (Kimi Linear: KDA layers and MLA full layers; GLM-5-Next's text model: KDA layers, MLA
#: with the pooled indexer, hyper-connections)
_KDA = ("kda",)
_ALL_GATHER_CACHES = ("replicated", "layer-split")

#: in the order a run's refusal is reported (the model's first: it names what cannot change)
REFUSALS: tuple[Refusal, ...] = (
    Refusal(("model", ("dsa",)), ("kv_cache", ("sharded",)),
            "LayerSplit holds within 3 % of a token-sharded pool with no ring (docs/dsa.md)",
            (("kv_cache", "layer-split"), ("kv_cache", "replicated")), "LayerSplit serves instead"),
    Refusal(("model", ("dsa",)), ("attention", ("flashinfer", "trtllm")),
            "DSA models run MLA with the indexer on the torch sparse-MLA reference or the Triton kernel",
            (("attention", "torch"), ("attention", "triton")), "sparse MLA kernels only"),
    Refusal(("model", ("dsa",)), ("graph", ("full",)),
            "the indexer's top-k and sparse attention read the live batch's segments on the host, in the break",
            (("graph", "breakable"),), "top-k reads the live batch"),
    Refusal(("model", ("dsa",)), ("attn_tp", (">1",)),
            "a DSA (MLA) model runs attention TP 1 under CP, as SGLang does (its latent KV is one head)",
            (("attn_tp", "1"),), "MLA: one KV head"),
    Refusal(("model", ("dsv4",)), ("kv_cache", ("sharded",)),
            "a DeepSeek V4 model's compressors pool the whole sequence on every rank; a token-sharded ring of its "
            "window, source rows and entries is not built",
            (("kv_cache", "layer-split"), ("kv_cache", "replicated")), "not built for V4's caches"),
    Refusal(("model", ("dsv4",)), ("attention", ("flashinfer", "trtllm", "triton")),
            "V4 attention (a window plus compressed entries, a sink per head, head_dim 512) runs on the torch "
            "reference in the attention break", (("attention", "torch"),), "torch reference only"),
    Refusal(("model", ("dsv4",)), ("aux", ("on",)),
            "a V4 layer's output is hc_mult residual streams, not one hidden row to copy out",
            (("model", "dense"), ("model", "moe")), "residual is hc_mult streams"),
    Refusal(("model", ("dsv4",)), ("draft", ("on",)),
            "an EAGLE-3 draft reads one hidden row a layer and caches per-head K/V; V4 has hc_mult streams and "
            "one shared KV head", (("model", "dense"), ("model", "moe")), "residual is hc_mult streams"),
    Refusal(("model", ("hybrid",)), ("layout", ("interleave",)),
            "a linear-attention hybrid's recurrence is scanned over each rank's contiguous blocks; interleave's "
            "one-token blocks would exchange a state map per token", (("layout", "zigzag"),),
            "a map per token"),
    Refusal(("model", ("hybrid",)), ("graph", ("full",)),
            "a linear-attention layer's scan reads the live batch's blocks on the host, in its break",
            (("graph", "breakable"),), "scan reads the live batch"),
    Refusal(("model", _KDA), ("kv_cache", ("sharded",)),
            "MLA caches one latent row a token for all its heads: a pass-KV ring would move the bytes the "
            "all-gather moves and a pass-Q ring queries wider than the latents, so a token-sharded pool would only "
            "save memory, which LayerSplit saves with no ring (docs/dsa.md)",
            (("kv_cache", "layer-split"), ("kv_cache", "replicated")), "LayerSplit serves instead"),
    Refusal(("model", _KDA), ("attention", ("flashinfer", "trtllm", "triton")),
            "a KDA hybrid's MLA layers attend on the torch latent-attention reference (Kimi's over every token, "
            "GLM-5-Next's over its pooled indexer's selection, which the Triton sparse-MLA backend's token top-k "
            "does not make); the other backends read per-head K/V",
            (("attention", "torch"),), "torch MLA"),
    Refusal(("model", _KDA), ("attn_tp", (">1",)),
            "a KDA hybrid's MLA layers cache one latent head a token, so it runs attention TP 1 under CP, as the "
            "DSA models do", (("attn_tp", "1"),), "MLA: one KV head"),
    Refusal(("model", _KDA), ("layout", ("interleave",)),
            "a KDA layer's recurrence is scanned over each rank's contiguous blocks; interleave's one-token blocks "
            "would exchange a state map per token", (("layout", "zigzag"),), "a map per token"),
    Refusal(("model", _KDA), ("draft", ("on",)),
            "an EAGLE-3 draft caches per-head K/V as one more layer of the target's cache, which holds MLA latents "
            "and KDA states", (("model", "dense"), ("model", "moe")), "latent cache"),
    Refusal(("model", ("dsa",)), ("draft", ("on",)),
            "an EAGLE-3 draft's K/V are per head, one more layer of the target's cache, and MLA caches latents",
            (("model", "dense"), ("model", "moe")), "MLA caches latents"),
    Refusal(("exchange", _RINGS), ("kv_cache", _ALL_GATHER_CACHES),
            "the rings run on the token-sharded cache; the replicated and layer-split caches all-gather K/V",
            (("kv_cache", "sharded"), ("exchange", "auto")), "rings need the sharded cache"),
    Refusal(("kv_cache", ("sharded",)), ("layout", ("interleave",)),
            "the ring's causal masks follow the zigzag blocks a rank stores",
            (("layout", "zigzag"),), "ring masks follow zigzag blocks"),
    Refusal(("kv_cache", ("sharded",)), ("graph", ("full",)),
            "the ring's point-to-point steps cannot be captured (NCCL send/recv under CUDA-graph capture is "
            "unsupported, pytorch #133984) and its per-step metadata changes with every batch",
            (("graph", "breakable"),), "ring steps cannot be captured"),
    Refusal(("kv_cache", ("layer-split",)), ("graph", ("full",)),
            "a cached prefix's pages of each layer are broadcast from the layer's owner in the attention break, "
            "sized by the live batch", (("graph", "breakable"),), "prefix pages fetched per batch"),
    Refusal(("graph", ("full",)), ("layout", ("interleave",)),
            "interleave gives every row its own segment, more than the captured metadata's 2 x max_requests",
            (("layout", "zigzag"), ("graph", "breakable")), "one segment a row"),
    Refusal(("graph", ("full",)), ("attention", ("torch", "trtllm")),
            "a full graph needs an attention backend that reads only static device metadata (torch runs on the "
            "host's segments; the engine passes trtllm no static max lengths yet)",
            (("attention", "triton"), ("attention", "flashinfer"), ("graph", "breakable")),
            "backend needs host metadata"),
    Refusal(("graph", ("full",)), ("moe", ("ep",)),
            "the expert-parallel exchange sizes its all-to-all from each batch's routing on the host",
            (("graph", "breakable"), ("moe", "tp")), "all-to-all sized per batch"),
    Refusal(("layout", ("interleave",)), ("attention", ("flashinfer", "trtllm")),
            "interleave's one-row segments make the kernel's batch as large as the rank's rows",
            (("attention", "torch"), ("attention", "triton"), ("layout", "zigzag")), "one segment a row"),
    Refusal(("pp", (">1",)), ("draft", ("on",)),
            "the draft runs after the target's whole body on one CP group's rows and reads layers of every stage",
            (("pp", "1"),), "reads every stage"),
    Refusal(("draft", ("on",)), ("import", ("on",)),
            "an EAGLE-3 draft's next step reads the target's hidden states of the request's last tokens, which no KV "
            "export carries", (("draft", "off"),), "reads hidden states"),
)


def applicable(settings: Mapping[str, str]) -> dict[str, str]:
    """``settings`` without the axes that mean nothing with the others (the MoE layout of
    a dense model); unknown keys or values raise ValueError (a caller's bug)."""
    out = {}
    for k, v in settings.items():
        if k not in AXES or v not in AXES[k].values:
            raise ValueError(f"combinations: unknown option {k}={v!r}")
        cond = AXES[k].applies
        if cond is not None and cond[0] in settings and settings[cond[0]] not in cond[1]:
            continue
        out[k] = v
    return out


def refusal(settings: Mapping[str, str]) -> Refusal | None:
    """The first refused pair among ``settings`` (axis -> value; absent axes are not
    known yet and refuse nothing), or None."""
    s = applicable(settings)
    return next((r for r in REFUSALS if r.matches(s)), None)


def check(settings: Mapping[str, str], flags: bool = False, family: str | None = None,
          names: Mapping[str, str] | None = None) -> None:
    """ConfigError, one line naming both options and why, if ``settings`` hold a refused
    pair; ``flags``: in the command line's names; ``family``: the model's, to name it;
    ``names``: axes named otherwise (:meth:`Refusal.message`)."""
    r = refusal(settings)
    if r is not None:
        raise ConfigError(r.message(applicable(settings), flags, family, names))


def runtime_settings(rt) -> dict[str, str]:
    """The axes a RuntimeConfig fixes by itself: not the MoE layout (it means something
    only with a MoE model), nor ``attention='auto'`` (known only on a device)."""
    s = {"dtype": rt.dtype, "layout": rt.layout, "graph": rt.graph, "kv_cache": rt.kv_cache,
         "exchange": rt.exchange, "aux": "on" if rt.aux_hidden_layers else "off",
         "draft": "on" if getattr(rt, "draft", None) else "off"}  # (a command without --draft: off)
    if rt.attention != "auto":
        s["attention"] = rt.attention
    if s["dtype"] not in AXES["dtype"].values:  # float16: API-only, combines as bfloat16 does
        s["dtype"] = "bfloat16"
    return s


def parallel_settings(parallel) -> dict[str, str]:
    """The axes a ParallelConfig fixes: pipeline stages, attention TP, attention DP."""
    return {"pp": "1" if parallel.pp_size == 1 else ">1", "attn_tp": "1" if parallel.attn_tp_size == 1 else ">1",
            "dp": "1" if parallel.dp_size == 1 else ">1"}


# ---- what follows is derived: pairs, the covering runs, the tables ----------------------

Pair = tuple[tuple[str, str], tuple[str, str]]


def _pair(a: tuple[str, str], b: tuple[str, str]) -> Pair:
    keys = list(AXES)
    return (a, b) if keys.index(a[0]) < keys.index(b[0]) else (b, a)


def all_pairs(values: Mapping[str, tuple[str, ...]] | None = None) -> list[Pair]:
    """Every pair of values of two different axes (``values``: a subset per axis)."""
    vals = values or {k: a.values for k, a in AXES.items()}
    keys = [k for k in AXES if k in vals]
    return [((ka, va), (kb, vb)) for ka, kb in combinations(keys, 2) for va in vals[ka] for vb in vals[kb]]


def _meaningful(pair: Pair) -> bool:
    """False for a pair one of whose axes does not apply given the other (moe x dense)."""
    return len(applicable(dict(pair))) == 2


def _complete(partial: dict[str, str], vals: Mapping[str, tuple[str, ...]]) -> dict[str, str] | None:
    """A whole configuration extending ``partial`` with no refused pair (the first in
    value order), or None."""
    rest = [k for k in vals if k not in partial]

    def extend(i: int, cur: dict[str, str]) -> dict[str, str] | None:
        if refusal(cur) is not None:
            return None
        if i == len(rest):
            return cur
        for v in vals[rest[i]]:
            done = extend(i + 1, {**cur, rest[i]: v})
            if done is not None:
                return done
        return None

    return extend(0, dict(partial))


def _why_implied(partial: dict[str, str], vals: Mapping[str, tuple[str, ...]]) -> tuple[str, list[Refusal]]:
    """For a pair no whole configuration holds: the first axis every value of which is
    refused alongside it, and the refusals met (in value order, each once)."""
    for k in vals:
        if k in partial:
            continue
        met = [refusal({**partial, k: v}) for v in vals[k]]
        if all(m is not None for m in met):
            return k, list(dict.fromkeys(met))
    raise AssertionError(f"combinations: no single axis explains why {partial} is refused")


def classify_pairs(values: Mapping[str, tuple[str, ...]] | None = None
                   ) -> tuple[list[Pair], list[tuple[Pair, Refusal]], list[tuple[Pair, tuple[str, list[Refusal]]]]]:
    """(allowed, refused, implied): every meaningful pair is allowed (some whole
    configuration holds it), refused by a declared Refusal, or refused by implication
    (every configuration holding it has a refused pair: the axis that forces it and the
    refusals its values meet are given). Computed once per set of values."""
    allowed, refused, implied = _classify_pairs(_key(values))
    return list(allowed), list(refused), list(implied)


@lru_cache(maxsize=4)
def _classify_pairs(key: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[tuple, tuple, tuple]:
    vals = dict(key)
    allowed, refused, implied = [], [], []
    for p in all_pairs(vals):
        if not _meaningful(p):
            continue
        s = dict(p)
        r = refusal(s)
        if r is not None:
            refused.append((p, r))
        elif _complete(s, vals) is not None:
            allowed.append(p)
        else:
            implied.append((p, _why_implied(s, vals)))
    return tuple(allowed), tuple(refused), tuple(implied)


def _held(run: Mapping[str, str]) -> set[Pair]:
    return {_pair(a, b) for a, b in combinations(run.items(), 2)}


def cpu_cost(run: Mapping[str, str]) -> float:
    """A run's relative time on a CPU, which the matrix test's runs keep low: Triton's
    kernels run in its interpreter, slower again with one-row segments (interleave) and
    as the sparse MLA kernel (DSA); pipeline stages, attention TP and DP each double the
    ranks (2 at CP 2 alone), and more ranks than cores cost more than their number."""
    cost = 1.0
    if run.get("attention") == "triton":
        cost *= 10 * (3 if run.get("layout") == "interleave" else 1) * (3 if run.get("model") == "dsa" else 1)
    return cost * 4.0 ** sum(run.get(k) == ">1" for k in ("pp", "attn_tp", "dp"))  # (ranks / 2) ** 2


def _grow(seed: Pair, vals: Mapping[str, tuple[str, ...]], todo: set[Pair]) -> dict[str, str]:
    """A whole configuration holding ``seed``: each other axis, in order, takes the value
    that holds most pairs of ``todo`` with the values taken so far per :func:`cpu_cost`."""
    run = dict(seed)
    for k in vals:
        if k in run or k not in applicable({**run, k: vals[k][0]}):  # taken, or meaningless with the run
            continue
        best, best_gain = None, None
        for v in vals[k]:
            trial = {**run, k: v}
            # the seed must stay meaningful (its MoE layout needs a MoE model)
            if not all(_meaningful(_pair(x, (k, v))) for x in seed) or _complete(trial, vals) is None:
                continue
            gain = len(_held(applicable(trial)) & todo) / cpu_cost(trial)
            if best is None or gain > best_gain:
                best, best_gain = v, gain
        run[k] = best
    return applicable({k: run[k] for k in vals if k in run})


def covering_runs(values: Mapping[str, tuple[str, ...]] | None = None) -> list[dict[str, str]]:
    """Whole configurations (the axes that apply), none with a refused pair, that
    together hold every allowed pair of ``values`` (greedy all-pairs, weighed by
    :func:`cpu_cost`; deterministic, computed once per set of values)."""
    return [dict(run) for run in _covering_runs(_key(values))]


def _key(values: Mapping[str, tuple[str, ...]] | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((k, tuple(v)) for k, v in (values or {k: a.values for k, a in AXES.items()}).items())


@lru_cache(maxsize=4)
def _covering_runs(key: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[tuple[tuple[str, str], ...], ...]:
    vals = dict(key)
    todo = set(classify_pairs(vals)[0])
    runs = []
    while todo:  # of the runs grown from each uncovered pair, keep the one covering most per cost
        best = max((_grow(seed, vals, todo) for seed in sorted(todo)),
                   key=lambda run: len(_held(run) & todo) / cpu_cost(run))
        todo -= _held(best)
        runs.append(tuple(best.items()))
    return tuple(runs)


def cpu_values() -> dict[str, tuple[str, ...]]:
    """Every axis's values that run on a CPU (not GPU_ONLY)."""
    return {k: tuple(v for v in a.values if v not in GPU_ONLY.get(k, ())) for k, a in AXES.items()}


def _flag_text(key: str, values: tuple[str, ...]) -> str:
    """An axis's values as the command line says them, in a table cell."""
    a = AXES[key]
    if key == "model":
        names = {"dsa": "DSA", "dsv4": "DeepSeek V4", "kda": "KDA"}
        return f"{'/'.join(names.get(v, v) for v in values)} models"
    if key == "attn_tp":  # (--tp over --cp x --dp: docs/parallel.md)
        return " or ".join(f"attention TP {'> 1' if v == '>1' else v}" for v in values)
    if key in ("aux", "export", "draft", "decode", "import", "pp", "dp"):
        return " or ".join(f"no `{a.flag}`" if _off(key, v) else f"`{a.say(v, True)}`" for v in values)
    return f"`{a.flag} {'/'.join(values)}`"


def _alternatives(instead: tuple[tuple[str, str], ...]) -> str:
    """``--graph breakable``, ``--kv-cache layer-split/replicated``: the alternatives,
    values of one option together."""
    by_key: dict[str, list[str]] = {}
    for k, v in instead:
        by_key.setdefault(k, []).append(v)
    return ", ".join(_flag_text(k, tuple(vals)) for k, vals in by_key.items())


def readme_table() -> str:
    """The README's table: each refused pair and why in a few words (what to use instead
    is in its error and in docs/combinations.md). A model kind's refusals share a row, and
    so do the others refused with one option for one reason."""
    rows = ["| refused | why |", "| --- | --- |"]
    groups: dict[tuple, list[Refusal]] = {}  # in order of first appearance
    for r in REFUSALS:
        groups.setdefault(("a", r.a) if r.a[0] == "model" else ("b", r.b, r.short), []).append(r)
    for key, group in groups.items():
        if key[0] == "a":
            others = ", ".join(_flag_text(*g.b) for g in group)
            why = "; ".join(dict.fromkeys(g.short for g in group))
            rows.append(f"| {_flag_text(*group[0].a)} + {others} | {why} |")
        else:
            rows.append(f"| {', '.join(_flag_text(*g.a) for g in group)} + {_flag_text(*group[0].b)} | "
                        f"{group[0].short} |")
    return "\n".join(rows)


def combinations_doc() -> str:
    """docs/combinations.md: the axes, every refused pair with its reason, the pairs
    refused by implication, and the runs the matrix test makes."""
    allowed, refused, implied = classify_pairs()
    cpu_runs = covering_runs(cpu_values())
    out = ["# Which options combine", "",
           "Which options run together, and why the others are refused. A refused pair ends a command before "
           "anything starts, with one line naming both flags and what to use instead:", "",
           "```sh", "graphcp run --kv-cache sharded --graph full    # exit 2: ... use --graph breakable", "```", "",
           "Generated from `graphcp/combinations.py` by `python scripts/combinations_doc.py` (a test checks it "
           "is current). Every pair of values below that is not refused combines, and "
           "`tests/test_combinations.py` runs each such pair at least once at CP 2 on a tiny model "
           "(with 2 stages, 2 attention-TP ranks and 2 attention-DP replicas where the run has them) against the "
           "single-rank eager engine, float32 and bfloat16 (a MoE "
           "model's bfloat16 runs take its all-experts twin, so that a router near-tie cannot flip an expert "
           "between two summation orders; a DSA model's twin also indexes every token, for its top-k).", "",
           "## The options", "", "| option | values | API | flag |", "| --- | --- | --- | --- |"]
    for a in AXES.values():
        note = f" (only with {a.applies[0]} {'/'.join(a.applies[1])})" if a.applies else ""
        out.append(f"| {a.key} | {', '.join(a.values)}{note} | `{a.api}` | `{a.flag}` |")
    out += ["", f"{len(allowed)} pairs combine, {len(refused)} are refused, {len(implied)} are refused by "
            "implication (every configuration holding them holds a refused pair).", "",
            "## Refused pairs", "", "| option | with | why | use instead |", "| --- | --- | --- | --- |"]
    for r in REFUSALS:
        (ka, va), (kb, vb) = r.a, r.b
        out.append(f"| {ka} {'/'.join(va)} | {kb} {'/'.join(vb)} | {r.reason} | {_alternatives(r.instead)} |")
    out += ["", "## Refused by implication", "", "| pair | every value of | meets |", "| --- | --- | --- |"]
    for ((ka, va), (kb, vb)), (axis, met) in implied:
        rules = "; ".join(f"{r.a[0]} {'/'.join(r.a[1])} with {r.b[0]} {'/'.join(r.b[1])}" for r in met)
        out.append(f"| {ka} {va}, {kb} {vb} | {axis} | {rules} |")
    gpu = ", ".join(f"{k} {'/'.join(v)}" for k, v in GPU_ONLY.items())
    out += ["", "## The runs", "",
            f"On a CPU the test runs the values a CPU can ({gpu} run only on a GPU: their pairs are allowed above, "
            "and their backends' tests run them through fakes that model the kernels; nothing has run on a GPU "
            f"yet). These {len(cpu_runs)} runs hold every allowed CPU pair:", "",
            "| # | " + " | ".join(AXES) + " |", "|---" * (len(AXES) + 1) + "|"]
    for i, run in enumerate(cpu_runs):
        out.append(f"| {i} | " + " | ".join(run.get(k, "-") for k in AXES) + " |")
    out += ["", "## Not options: what a device runs", "",
            "- `--attention triton` on a CPU runs Triton's interpreter (the command sets `TRITON_INTERPRET=1`; the "
            "API refuses it unless set before triton is imported).",
            "- `--moe tp` with graphs on CUDA keeps the experts in the break unless torch's grouped matmul is "
            "sync-free and capturable there (docs/moe.md); full graphs with `tp` are refused on CUDA until a "
            "captured grouped matmul replays correctly.",
            "- DSA models under `--pp`: a stage may not start at a GLM-5 'shared' indexer layer (it reuses the "
            "top-k of the layer before it); `--pp-layers` moves the boundary. So for GLM-5-Next's 'shared' layers.",
            "- GLM-5-Next (a KDA model) with `--aux-hidden-layers`: refused by its family, as V4 is here (a layer's "
            "output is hc_mult residual streams, not one hidden row); Kimi Linear, the other KDA model, runs it.",
            "- `flashinfer` and `trtllm` need CUDA (trtllm: SM100/SM103).", ""]
    return "\n".join(out)
