"""Parallel and runtime configs, validated up front (the model's own config is
:class:`graphcp.model.config.ModelConfig`).

Configs are frozen: everything that shapes a forward (and so a captured graph)
is decided before the first batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcp.checks import (
    DEFAULT_DECODE_BUCKETS,
    MAX_CP,
    MAX_DECODE_BUCKETS,
    MAX_GB_PER_S,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_PAGE_SIZE,
    MAX_REQUESTS,
    MAX_TFLOPS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    check_bool,
    check_float,
    check_int,
    check_layer_list,
    check_str,
)
from graphcp.combinations import check as check_combination
from graphcp.combinations import runtime_settings
from graphcp.errors import ConfigError
from graphcp.options import (
    ATTENTION_BACKENDS,
    DECODE_MERGES,
    EXCHANGES,
    GRAPH_BACKENDS,
    GRAPH_MODES,
    KV_CACHE_MODES,
    LAYOUTS,
    MOE_LAYOUTS,
    AttentionName,
    DecodeMergeName,
    DtypeName,
    ExchangeName,
    GraphBackendName,
    GraphMode,
    KVCacheMode,
    LayoutName,
    MoeLayout,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline stage: which decoder layers it holds, and whether it holds the
    embedding (the first stage) and the final norm + LM head (the last stage)."""

    index: int
    num_stages: int
    layers: range  # global decoder-layer indices, contiguous

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def default_stage_counts(num_layers: int, pp_size: int) -> list[int]:
    """Decoder layers per pipeline stage when none are given: an even split, and when
    ``num_layers`` does not divide by ``pp_size`` the extra layers go one each to the
    stages just before the last, from the second-to-last backwards (vLLM's rule): the
    last stage also runs the final norm and the LM head, the first only the embedding,
    so this keeps the busiest stage as light as a split can (10 layers over 4 stages:
    2, 3, 3, 2)."""
    counts = [num_layers // pp_size] * pp_size
    for s in range(num_layers % pp_size):
        counts[-2 - s] += 1
    return counts


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel degrees graphcp honours, validated up front (docs/parallel.md).

    A pipeline stage holds ``tp_size`` = T ranks (the FFN's tensor-parallel group: the
    dense MLP and the MoE layers run over all T), subdivided SGLang's way into
    ``dp_size`` = D attention replicas of ``cp_size`` = C context-parallel partitions of
    ``attn_tp_size`` = T / (D x C) attention-TP ranks (heads split). CP subdivides the TP
    world: it adds no GPU multiplier. ``tp_size`` defaults to C x D (attention TP 1: the
    MLP is TP-sharded over the CP group, TP = CP). ``pp_size`` pipeline stages each hold
    that mesh and a contiguous range of decoder layers (an even split with the extra
    layers before the last stage, :func:`default_stage_counts`, or ``pp_layers`` layers
    per stage). Ranks: stage-major, then (dp, cp, attn_tp) with attention TP fastest
    (:mod:`graphcp.mesh`); world = P x T."""

    cp_size: int = 1
    pp_size: int = 1
    #: decoder layers of each stage, in stage order (None: an even split)
    pp_layers: tuple[int, ...] | None = None
    #: ranks of a stage, the FFN's TP degree (None: cp_size x dp_size, attention TP 1)
    tp_size: int | None = None
    #: attention data-parallel replicas of a stage
    dp_size: int = 1

    def __post_init__(self) -> None:
        w = "ParallelConfig"
        check_int(self.cp_size, "cp_size", lo=1, hi=MAX_CP, where=w)
        check_int(self.pp_size, "pp_size", lo=1, hi=MAX_LAYERS, where=w)
        check_int(self.dp_size, "dp_size", lo=1, hi=MAX_CP, where=w)
        if self.tp_size is None:
            object.__setattr__(self, "tp_size", self.cp_size * self.dp_size)
        check_int(self.tp_size, "tp_size", lo=1, hi=MAX_CP, where=w)
        split = self.cp_size * self.dp_size
        if self.tp_size % split:
            raise ConfigError(
                f"{w}: tp_size={self.tp_size} must be a multiple of dp_size x cp_size = {self.dp_size} x "
                f"{self.cp_size} = {split} (attention TP = tp / (dp x cp); CP subdivides the TP world): change "
                f"tp_size to a multiple of {split}, or cp_size / dp_size to divide {self.tp_size}")
        if self.pp_layers is not None:
            if isinstance(self.pp_layers, (str, bytes)) or not isinstance(self.pp_layers, (tuple, list)):
                raise ConfigError(f"{w}: pp_layers must be a list of layer counts, one per stage, "
                                  f"got {self.pp_layers!r}"[:300])
            for s, n in enumerate(self.pp_layers):
                check_int(n, f"pp_layers[{s}] (layers of stage {s})", lo=1, hi=MAX_LAYERS, where=w)
            if len(self.pp_layers) != self.pp_size:
                raise ConfigError(f"{w}: pp_layers lists {len(self.pp_layers)} stages "
                                  f"({list(self.pp_layers)}), expected pp_size={self.pp_size}")
            object.__setattr__(self, "pp_layers", tuple(int(n) for n in self.pp_layers))

    @property
    def attn_tp_size(self) -> int:
        """Attention tensor parallelism inside each CP partition: T / (D x C)."""
        return self.tp_size // (self.dp_size * self.cp_size)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    def stage_layers(self, num_layers: int, source: str = "the model", flags: bool = False) -> list[range]:
        """Each stage's decoder layers (contiguous ranges, in stage order): ``pp_layers``
        when given, else :func:`default_stage_counts`; ConfigError when they do not fit
        ``num_layers`` (``flags``: named as the command line's flags)."""
        P = self.pp_size
        if self.pp_layers is None:
            if num_layers < P:
                raise ConfigError(f"{source}: {f'--pp {P}' if flags else f'pp_size={P}'} is more than "
                                  f"num_hidden_layers={num_layers}; each pipeline stage needs at least one decoder "
                                  "layer")
            counts = default_stage_counts(num_layers, P)
        else:
            counts = list(self.pp_layers)
            if sum(counts) != num_layers:
                given = f"--pp-layers {','.join(map(str, counts))}" if flags else f"ParallelConfig.pp_layers={counts}"
                raise ConfigError(f"{source}: {given} sums to {sum(counts)} layers, the model has "
                                  f"num_hidden_layers={num_layers}")
        starts = [sum(counts[:s]) for s in range(P)]
        return [range(a, a + n) for a, n in zip(starts, counts)]

    def stage(self, index: int, num_layers: int) -> PipelineStage:
        return PipelineStage(index, self.pp_size, self.stage_layers(num_layers)[index])


@dataclass(frozen=True)
class RuntimeConfig:
    """How a PrefillEngine runs (everything but the model and the parallel degrees).
    Frozen and checked on construction; errors name the field."""

    dtype: DtypeName = "float32"
    device: str = "cpu"  # cpu | cuda | cuda:N
    page_size: int = 16
    #: KV pool size in tokens (rounded up to pages); None: enough for max_position_embeddings x 4
    kv_tokens: int | None = None
    attention: AttentionName = "torch"
    graph: GraphMode = "off"
    graph_backend: GraphBackendName = "auto"
    layout: LayoutName = "zigzag"
    #: requests a captured body holds (static segment metadata capacity)
    max_requests: int = 64
    debug_graphs: bool = False
    #: replay each new bucket once on a synthetic batch and compare it bitwise with the
    #: same-bucket eager body (CaptureError on a difference); None: on for the trace
    #: graph backend, off for cuda (where it costs about two forwards per bucket)
    verify_capture: bool | None = None
    check_consistency: bool = True
    collective_timeout_s: float = 300.0
    #: "replicated": every rank ends a forward holding the batch's whole KV (all-gather);
    #: "sharded": each rank stores only its own zigzag blocks, attention runs a ring
    #: (docs/sharded_kv.md). kv_tokens is then one rank's pool.
    #: "layer-split": rank r keeps the cache of its ceil(L / C) layers and one scratch layer
    #: (docs/pd.md); kv_tokens is the same pool capacity as with "replicated"
    kv_cache: KVCacheMode = "replicated"
    #: the sharded cache's ring: "pass-kv", "pass-q", or "auto" (chosen per batch from its
    #: new and cached tokens, the heads and the two hardware figures below)
    exchange: ExchangeName = "auto"
    #: peak dense attention FLOP/s of one GPU, in TFLOP/s (default: H100/H200 SXM bf16 dense)
    peak_tflops: float = 989.0
    #: link bandwidth per direction per GPU, in GB/s (default: H100/H200 NVLink 4, 450 GB/s)
    link_gb_per_s: float = 450.0
    #: mixture-of-experts layers: "ep" splits the experts over the CP group (all-to-all
    #: dispatch and combine, an eager graph break), "tp" shards every expert like the
    #: dense MLP (inside the captured graphs); dense models ignore it
    moe: MoeLayout = "ep"
    #: decoder layers whose output hidden states prefill returns by default (for a
    #: speculative-decoding draft model); graphs copy these layers' rows inside the
    #: captured segments, so with graphs a call may ask only for a subset of them
    aux_hidden_layers: tuple[int, ...] = ()
    #: micro-batches a prefill is pipelined as by default (pipeline parallelism)
    microbatches: int = 1
    #: an EAGLE-3 draft checkpoint (a folder): every prefill then also runs the draft over
    #: the same rows and caches its layer's K/V (docs/speculative.md); None: no draft
    draft: str | None = None
    #: how a decode step over the token-sharded cache merges the ranks' partial attention:
    #: "all-gather", "all-to-all", or "auto" (the one that moves fewer bytes; docs/decode.md)
    decode_merge: DecodeMergeName = "auto"
    #: the decode batch sizes a decode graph is captured for (graph modes; increasing); a
    #: step of more requests than the largest runs eagerly
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    #: a linear-attention hybrid's cache (docs/hybrid.md): the live requests whose recurrent
    #: and convolution states it keeps per linear layer (two slots each); None: max_requests
    state_slots: int | None = None

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        check_str(self.device, "device", where="RuntimeConfig")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_int(self.page_size, "page_size", lo=1, hi=MAX_PAGE_SIZE, where="RuntimeConfig")
        if self.kv_tokens is not None:  # 0 is not "the default": None is
            check_int(self.kv_tokens, "kv_tokens", lo=1, hi=MAX_TOKENS, where="RuntimeConfig")
        for name, allowed in (("graph", GRAPH_MODES), ("graph_backend", GRAPH_BACKENDS), ("layout", LAYOUTS),
                              ("attention", ATTENTION_BACKENDS), ("kv_cache", KV_CACHE_MODES),
                              ("exchange", EXCHANGES), ("decode_merge", DECODE_MERGES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"RuntimeConfig.{name} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, name)!r}")
        check_int(self.max_requests, "max_requests", lo=1, hi=MAX_REQUESTS, where="RuntimeConfig")
        check_bool(self.debug_graphs, "debug_graphs", where="RuntimeConfig")
        check_bool(self.check_consistency, "check_consistency", where="RuntimeConfig")
        check_float(self.collective_timeout_s, "collective_timeout_s", lo=0, lo_open=True, hi=MAX_TIMEOUT_S,
                    where="RuntimeConfig")
        if self.moe not in MOE_LAYOUTS:
            raise ConfigError(f"RuntimeConfig.moe must be one of {', '.join(MOE_LAYOUTS)}, got {self.moe!r}")
        check_float(self.peak_tflops, "peak_tflops", lo=0, lo_open=True, hi=MAX_TFLOPS, where="RuntimeConfig")
        check_float(self.link_gb_per_s, "link_gb_per_s", lo=0, lo_open=True, hi=MAX_GB_PER_S, where="RuntimeConfig")
        object.__setattr__(self, "aux_hidden_layers", check_layer_list(
            self.aux_hidden_layers, "RuntimeConfig.aux_hidden_layers", MAX_LAYERS, err=ConfigError))
        check_int(self.microbatches, "microbatches", lo=1, hi=MAX_MICROBATCHES, where="RuntimeConfig")
        self._check_decode_buckets()
        if self.state_slots is not None:  # (None: max_requests)
            check_int(self.state_slots, "state_slots", lo=1, hi=MAX_REQUESTS, where="RuntimeConfig")
        # the pairs of these fields that do not run together (graphcp/combinations.py)
        check_combination(runtime_settings(self))
        self._check_draft()

    def _check_decode_buckets(self) -> None:
        """Increasing batch sizes >= 1, at most :data:`MAX_DECODE_BUCKETS` of them, each at
        most MAX_REQUESTS."""
        b = self.decode_buckets
        if isinstance(b, (str, bytes)) or not isinstance(b, (tuple, list)) or not 1 <= len(b) <= MAX_DECODE_BUCKETS:
            raise ConfigError(f"RuntimeConfig.decode_buckets must list 1 to {MAX_DECODE_BUCKETS} batch sizes, "
                              f"got {b!r}"[:300])
        for i, n in enumerate(b):
            check_int(n, f"decode_buckets[{i}]", lo=1, hi=MAX_REQUESTS, where="RuntimeConfig")
        if any(x >= y for x, y in zip(b, b[1:])):
            raise ConfigError(f"RuntimeConfig.decode_buckets must be increasing, got {list(b)}")
        object.__setattr__(self, "decode_buckets", tuple(int(n) for n in b))

    def _check_draft(self) -> None:
        """A draft runs after the target's whole body, over the same rows: not yet in
        micro-batches."""
        if self.draft is None:
            return
        check_str(self.draft, "draft", where="RuntimeConfig")
        if self.microbatches != 1:
            raise ConfigError(f"RuntimeConfig.draft runs one forward a batch, got microbatches={self.microbatches} "
                              "(micro-batches and pipeline stages are not built for a draft; expected 1)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
