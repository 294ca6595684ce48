"""What one GPU-check run checks: the GPU defaults, ``--dry-run``'s tiny CPU ones,
and the flags that change them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from graphcp.model.presets import PRESETS

LARGE_MODEL = "qwen3-1b-like"
#: the parts of a run, in order, with the seconds each may take on one H200 (docs/gpu_check.md):
#: the default run, which fits a lent machine's lease with room for a rerun; time a part
#: leaves unused passes to the next. moe_graph is last: an illegal memory access at replay
#: (what it looks for) ends the CUDA context
PHASES = {"warmup": 25.0, "kernels": 15.0, "sparse_mla": 10.0, "graphs": 25.0, "engines": 30.0, "hybrid": 8.0,
          "host": 5.0, "timing": 25.0, "launches": 12.0, "moe_graph": 8.0}
#: ``--full``: the larger model, 32K tokens, more kernel plans
FULL_PHASES = {"warmup": 45.0, "kernels": 45.0, "sparse_mla": 30.0, "graphs": 60.0, "engines": 45.0, "hybrid": 15.0,
               "host": 5.0, "timing": 160.0, "launches": 40.0, "moe_graph": 30.0}
#: a dry run's shares are generous: it proves the flow on a shared CPU, where a share that
#: runs out would fail the run (a skipped part fails it) for the machine's load alone
DRY_PHASES = {"warmup": 120.0, "kernels": 120.0, "sparse_mla": 60.0, "graphs": 180.0, "engines": 240.0,
              "hybrid": 120.0, "host": 30.0, "timing": 120.0, "launches": 60.0, "moe_graph": 60.0}
PARTS = tuple(PHASES)
#: seconds kept for the report after the parts; Python, torch and the CUDA context before
#: the budget starts (outside it, inside the command's limit)
RESERVE_S, DRY_RESERVE_S = 10.0, 2.0
STARTUP_S = 20.0
#: the whole run's budget: the parts' shares and the report's reserve (start-up comes on top)
BUDGET_S = sum(PHASES.values()) + RESERVE_S
FULL_BUDGET_S = sum(FULL_PHASES.values()) + RESERVE_S
DRY_BUDGET_S = sum(DRY_PHASES.values()) + DRY_RESERVE_S
#: what the default run may take on the lent machine, start-up included (its lease keeps room
#: for a rerun): the command's limit in docs/gpu_check.md is this plus the item in flight
PLANNED_LIMIT_S = 200.0


def planned_s(budget_s: float) -> float:
    """Seconds a run of budget ``budget_s`` plans for on the device: start-up and the budget."""
    return STARTUP_S + budget_s


@dataclass
class Settings:
    """Everything a run needs, resolved from the command line (and --dry-run)."""

    dry_run: bool
    device: str
    graph_backend: str  # cuda | trace
    # kernel check
    check_dtypes: tuple[str, ...]
    check_heads: tuple[tuple[int, int, int], ...]  # (q heads, kv heads, head_dim)
    check_random_plans: int
    check_max_extend: int
    check_max_prefix: int
    page_size: int
    # graph check (default model, CP = 1)
    graph_dtypes: tuple[str, ...]
    graph_attention: dict[str, str]  # graph mode -> attention backend
    graph_buckets: tuple[int, ...]
    graph_batches: tuple[tuple[int, ...], ...]  # new tokens per request, one tuple a batch
    # sparse MLA kernel (DSA) against the torch form at a row count past the old int32 offsets
    sparse_dtypes: tuple[str, ...]
    sparse_shape: tuple[int, int, int, int]  # (query rows, heads, kv_lora_rank, rope dim)
    sparse_topk: int  # selected tokens a row
    sparse_tokens: int  # cached tokens the rows select from
    sparse_checked_rows: int  # rows compared with the reference (the last ones among them)
    # MoE layer (tp layout, grouped matmuls) captured, replayed with changing routing
    moe_dtypes: tuple[str, ...]
    moe_shape: tuple[int, int, int, int, int]  # (rows, hidden, experts, top_k, expert intermediate)
    moe_replays: int
    # engines at CP 1 beyond the dense model (DeepSeek V4, MoE tp held out and ep, an EAGLE-3 draft's graphs)
    engine_bucket: int
    engine_batch: tuple[int, int, int]  # (cached prefix, its extension, another request)
    # the linear-attention hybrid (graphcp.gpucheck.hybrid): float32 first (the reference)
    hybrid_dtypes: tuple[str, ...]
    hybrid_batch: tuple[int, ...]  # new tokens per request of the varlen batch: one long, the rest short
    # host preparation: one rank of a CP group, requests a batch, timed repeats
    host_cp: int
    host_requests: int
    host_repeats: int
    # timing
    timing_dtype: str
    models: tuple[str, ...]
    large_layers: int | None
    sizes: tuple[int, ...]
    timing_backends: tuple[str, ...]
    repeats: int
    warmup: int
    item_cap_s: float
    profile: bool
    seed: int
    full: bool = False
    phases: dict[str, float] = field(default_factory=dict)


def settings_from_args(a: argparse.Namespace) -> Settings:
    """The flags of ``graphcp gpu-check`` (:mod:`graphcp.gpucheck.cli`) with the GPU or dry-run defaults."""
    dry, full = a.dry_run, a.full and not a.dry_run
    models = a.models or (("default", LARGE_MODEL) if full else ("default",))
    if a.skip_large:
        models = tuple(m for m in models if m != LARGE_MODEL)
    return Settings(
        dry_run=dry,
        device="cpu" if dry else "cuda",
        graph_backend="trace" if dry else "cuda",
        check_dtypes=("float32", "bfloat16"),
        check_heads=((2, 1, 64), (2, 1, 128)) if dry else ((8, 2, 64), (16, 4, 128)),
        check_random_plans=1 if dry else 4 if full else 2,
        check_max_extend=24 if dry else 3000,
        check_max_prefix=20 if dry else 2000,
        page_size=16,
        # the CPU trace backend replays float32 bodies exactly; bfloat16 is checked on the GPU
        graph_dtypes=("float32",) if dry else ("bfloat16", "float32"),
        # dry run: the interpreted Triton kernel only where it must be (inside the full graph)
        graph_attention={"breakable": "torch" if dry else "triton", "full": "triton"},
        graph_buckets=(48,) if dry else (256, 1024),
        graph_batches=((9, 3, 20),) if dry else ((700,), (300, 9, 61, 2), (1000,)),
        sparse_dtypes=("float32", "bfloat16"),
        # GPU: DeepSeek V3.2's 128 heads x 512 latent over 34,000 rows: 2.2e9 q_lat elements (> 2**31)
        sparse_shape=(40, 16, 32, 8) if dry else (34000, 128, 512, 64),
        sparse_topk=16 if dry else 64,
        sparse_tokens=48 if dry else 4096,
        sparse_checked_rows=40 if dry else 512,
        # the CUDA path is bfloat16 (the grouped matmul's sync-free kernel); the trace backend replays float32
        moe_dtypes=("float32",) if dry else ("bfloat16",),
        moe_shape=(24, 64, 8, 2, 32) if dry else (2048, 2048, 64, 8, 768),
        moe_replays=3 if dry else 5,
        engine_bucket=32 if dry else 64,
        engine_batch=(21, 9, 5),
        hybrid_dtypes=("float32", "bfloat16"),
        # the case: one long request beside fifteen short ones (they were padded to it)
        hybrid_batch=(70, 5, 5, 5) if dry else (2000,) + (100,) * 15,
        host_cp=8,
        host_requests=16,
        host_repeats=20 if dry else 200,
        timing_dtype="float32" if dry else "bfloat16",
        models=models,
        large_layers=a.large_layers or None,
        sizes=a.sizes or ((32, 96) if dry else (1024, 8192, 32768) if full else (1024, 8192)),
        timing_backends=a.backends or (("torch",) if dry else ("triton",)),
        repeats=a.repeats or (2 if dry else 5),
        warmup=a.warmup or (1 if dry else 2),
        item_cap_s=a.item_cap_s or (2.0 if dry else 8.0 if full else 4.0),
        profile=not a.no_profile,
        seed=a.seed,
        full=full,
        phases=dict(DRY_PHASES if dry else FULL_PHASES if full else PHASES),
    )


def default_budget_s(st: Settings) -> float:
    """The run's budget when ``--budget-s`` is not given."""
    return DRY_BUDGET_S if st.dry_run else FULL_BUDGET_S if st.full else BUDGET_S


def model_heads(models: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(q heads, kv heads, head_dim) of each preset in ``models``."""
    return [(c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
            for c in (PRESETS[m] for m in models if m in PRESETS)]
