"""What one GPU-check run checks: the GPU defaults, ``--dry-run``'s tiny CPU ones,
and the flags that change them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from graphcp.model.presets import PRESETS

LARGE_MODEL = "qwen3-1b-like"
#: the parts of a run, in order, with the seconds each may take on one H200 (docs/gpu_check.md);
#: time a part leaves unused passes to the next
#: moe_graph is last: an illegal memory access at replay (what it looks for) ends the CUDA context
PHASES = {"warmup": 45.0, "kernels": 45.0, "sparse_mla": 30.0, "graphs": 60.0, "timing": 160.0, "launches": 40.0,
          "moe_graph": 30.0}
DRY_PHASES = {"warmup": 20.0, "kernels": 40.0, "sparse_mla": 20.0, "graphs": 60.0, "timing": 60.0, "launches": 20.0,
              "moe_graph": 20.0}
PARTS = tuple(PHASES)
#: the whole run's budget: the parts' shares, start-up and the report fit it (a 540 s device limit)
BUDGET_S = 420.0


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
    phases: dict[str, float] = field(default_factory=dict)


def settings_from_args(a: argparse.Namespace) -> Settings:
    """The flags of ``graphcp gpu-check`` (:mod:`graphcp.gpucheck.cli`) with the GPU or dry-run defaults."""
    dry = a.dry_run
    models = a.models or (("default",) if dry else ("default", LARGE_MODEL))
    if a.skip_large:
        models = tuple(m for m in models if m != LARGE_MODEL)
    return Settings(
        dry_run=dry,
        device="cpu" if dry else "cuda",
        graph_backend="trace" if dry else "cuda",
        check_dtypes=("float32", "bfloat16"),
        check_heads=((2, 1, 64), (2, 1, 128)) if dry else ((8, 2, 64), (16, 4, 128)),
        check_random_plans=1 if dry else 4,
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
        timing_dtype="float32" if dry else "bfloat16",
        models=models,
        large_layers=a.large_layers or None,
        sizes=a.sizes or ((32, 96) if dry else (1024, 8192, 32768)),
        timing_backends=a.backends or (("torch",) if dry else ("triton",)),
        repeats=a.repeats or (2 if dry else 5),
        warmup=a.warmup or (1 if dry else 2),
        item_cap_s=a.item_cap_s or (2.0 if dry else 8.0),
        profile=not a.no_profile,
        seed=a.seed,
        phases=dict(DRY_PHASES if dry else PHASES),
    )


def model_heads(models: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """(q heads, kv heads, head_dim) of each preset in ``models``."""
    return [(c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
            for c in (PRESETS[m] for m in models if m in PRESETS)]
