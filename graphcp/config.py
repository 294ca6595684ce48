"""Model, parallel and runtime configs, validated up front.

Configs are frozen: everything that shapes a forward (and so a captured graph)
is decided before the first batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphcp.checks import MAX_CP, MAX_TOKENS, check_bool, check_float, check_int, check_layer_list, check_str
from graphcp.dsa_config import DsaConfig, dsa_from_hf
from graphcp.errors import ConfigError
from graphcp.options import (
    ATTENTION_BACKENDS,
    EXCHANGES,
    GRAPH_BACKENDS,
    GRAPH_MODES,
    KV_CACHE_MODES,
    LAYOUTS,
    AttentionName,
    DtypeName,
    ExchangeName,
    GraphBackendName,
    GraphMode,
    KVCacheMode,
    LayoutName,
)
from graphcp.moe_config import MoeConfig, moe_from_hf
from graphcp.options import MOE_LAYOUTS, MoeLayout
from graphcp.rope import RopeConfig, rope_from_hf

#: HF ``architectures`` entries (and ``model_type`` fallbacks) this decoder covers
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    # DeepSeek Sparse Attention models (graphcp/dsa_config.py, graphcp/model/dsa/)
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: sane upper bounds on model sizes (far above any real checkpoint)
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_POSITIONS = 1 << 24  # the RoPE tables hold every position


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | deepseek_v32 | glm_moe_dsa
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool  # bias on o_proj (Llama's attention_bias covers o_proj too)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    torch_dtype: str | None = None
    #: mixture-of-experts layers (None: every layer runs the dense MLP)
    moe: MoeConfig | None = None
    #: MLA + the DSA indexer (+ DeepSeek MoE, in dsa.moe); None for other families. DSA
    #: models set num_kv_heads = num_heads and head_dim = qk_rope_head_dim (RoPE's width)
    dsa: DsaConfig | None = None

    def __post_init__(self) -> None:
        w = "ModelConfig"
        for name, hi in (("vocab_size", MAX_VOCAB), ("hidden_size", MAX_HIDDEN), ("intermediate_size", MAX_INTERMEDIATE),
                         ("num_layers", MAX_LAYERS), ("num_heads", MAX_HEADS), ("num_kv_heads", MAX_HEADS),
                         ("head_dim", MAX_HEAD_DIM), ("max_position_embeddings", MAX_POSITIONS)):
            check_int(getattr(self, name), name, lo=1, hi=hi, where=w)
        if self.head_dim % 2:
            raise ConfigError(f"{w}: head_dim must be even (RoPE rotates halves), got {self.head_dim}")
        check_float(self.rms_norm_eps, "rms_norm_eps", lo=0.0, hi=1.0, where=w)
        if not isinstance(self.rope, RopeConfig):
            raise ConfigError(f"{w}: rope must be a RopeConfig, got {self.rope!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def has_dense_mlp(self) -> bool:
        """Whether some layer runs the dense MLP (``intermediate_size``)."""
        return self.moe is None or len(self.moe.layers) < self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Read a Hugging Face config.json. Every key graphcp reads is type- and
        range-checked; a bad one is a ConfigError naming the file, the key, the value
        and what was expected."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object (the model's config), got {type(d).__name__}")
        archs = d.get("architectures")
        archs = [] if archs is None else archs
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: architectures must be a list of class names, got {archs!r}"[:300])
        family = None
        if archs:
            unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
            if unsupported:
                raise ConfigError(
                    f"{source}: unsupported architectures entry {unsupported[0]!r}; "
                    f"graphcp supports {sorted(SUPPORTED_ARCHITECTURES)}"
                )
            family = SUPPORTED_ARCHITECTURES[archs[0]]
        else:
            family = d.get("model_type")
            if not isinstance(family, str) or family not in SUPPORTED_ARCHITECTURES.values():
                raise ConfigError(
                    f"{source}: no architectures entry and unsupported model_type {family!r}; "
                    f"graphcp supports {sorted(SUPPORTED_ARCHITECTURES)}"
                )

        def num(key: str, hi: int, default: Any = ...) -> int:
            # a missing key takes its default; an optional key set to null too (as transformers)
            if key not in d or (d[key] is None and default is not ...):
                if default is ...:
                    raise ConfigError(f"{source}: missing required key {key!r}")
                return default
            return check_int(d[key], key, lo=1, hi=hi, where=source)

        def flag(key: str, default: bool) -> bool:
            v = d.get(key)
            return default if v is None else check_bool(v, key, where=source)

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        max_pos = num("max_position_embeddings", MAX_POSITIONS, None)
        window = d.get("sliding_window")
        if window is not None:
            window = check_int(window, "sliding_window", lo=0, hi=MAX_TOKENS, where=source)
        use_window = flag("use_sliding_window", family in ("mistral", "mixtral"))
        if window is not None and use_window and window < (max_pos or 0):
            raise ConfigError(
                f"{source}: sliding_window={window} attention is not supported (graphcp attends the full context)"
            )
        heads = num("num_attention_heads", MAX_HEADS)
        hidden = num("hidden_size", MAX_HIDDEN)
        head_dim = num("head_dim", MAX_HEAD_DIM, None)
        if head_dim is None:
            head_dim = hidden // heads
            if head_dim < 2:
                raise ConfigError(f"{source}: hidden_size={hidden} // num_attention_heads={heads} gives head_dim "
                                  f"{head_dim}; expected >= 2 (or give head_dim)")
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even (RoPE rotates halves), got {head_dim}")
        eps = d.get("rms_norm_eps")
        dtype = d.get("torch_dtype") or d.get("dtype")
        if dtype is not None:
            check_str(dtype, "torch_dtype", where=source)
        attention_bias = flag("attention_bias", False)
        num_layers = num("num_hidden_layers", MAX_LAYERS)
        rope = rope_from_hf(d, source, max_pos)
        dsa = dsa_from_hf(d, family, num_layers, rope, source)
        return cls(
            family=family,
            vocab_size=num("vocab_size", MAX_VOCAB),
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", MAX_INTERMEDIATE),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=num("num_key_value_heads", MAX_HEADS, heads),
            head_dim=head_dim if dsa is None else dsa.qk_rope_head_dim,
            rms_norm_eps=1e-6 if eps is None else check_float(eps, "rms_norm_eps", lo=0.0, hi=1.0, where=source),
            rope=rope,
            max_position_embeddings=4096 if max_pos is None else max_pos,
            tie_word_embeddings=flag("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            mlp_bias=flag("mlp_bias", False),
            torch_dtype=dtype,
            moe=moe_from_hf(d, family, num_layers, source),
            dsa=dsa,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(p))


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


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel degrees graphcp honours, validated up front: ``cp_size`` ranks of
    context parallelism, whose group is also the tensor-parallel group of the MLP
    (TP = CP; attention weights are whole on every rank), and ``pp_size`` pipeline
    stages, each a CP group holding a contiguous range of decoder layers (an even
    split, or ``pp_layers`` layers per stage). Ranks are stage-major: global rank
    ``s * cp_size + r`` is CP rank ``r`` of stage ``s``. Degrees that graphcp does
    not run yet have no field here, so none can be set and silently ignored; new
    kinds of parallelism add their degree here, with the world size to match."""

    cp_size: int = 1
    pp_size: int = 1
    #: decoder layers of each stage, in stage order (None: an even split)
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        w = "ParallelConfig"
        check_int(self.cp_size, "cp_size", lo=1, hi=MAX_CP, where=w)
        check_int(self.pp_size, "pp_size", lo=1, hi=MAX_LAYERS, where=w)
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
    def tp_size(self) -> int:
        """The MLP's tensor-parallel degree: the CP group's size."""
        return self.cp_size

    @property
    def world_size(self) -> int:
        return self.pp_size * self.cp_size

    def check_model(self, m: ModelConfig, source: str = "the model", moe: MoeLayout = "ep") -> None:
        """Refuse a model whose sharded sizes do not divide by the TP degree (or, with
        mixture-of-experts layers, whose experts do not split over the group as ``moe``
        asks: see :meth:`MoeConfig.check_parallel`), or whose layers do not split into
        the pipeline stages."""
        for experts in (m.moe, m.dsa.moe if m.dsa is not None else None):  # DeepSeek MoE lives in m.dsa
            if experts is not None:
                experts.check_parallel(self.cp_size, moe, source, m.hidden_size)
        dense = m.has_dense_mlp if m.dsa is None else m.dsa.has_dense_layers(m.num_layers)
        if dense and m.intermediate_size % self.tp_size:
            raise ConfigError(
                f"{source}: intermediate_size={m.intermediate_size} does not divide by tp_size=cp_size="
                f"{self.tp_size}; the MLP is column/row-parallel over the CP group"
            )
        self.stage_layers(m.num_layers, source)

    def stage_layers(self, num_layers: int, source: str = "the model") -> list[range]:
        """Each stage's decoder layers (contiguous ranges, in stage order); ConfigError
        when ``num_layers`` does not split as configured."""
        P = self.pp_size
        if self.pp_layers is None:
            if num_layers % P:
                raise ConfigError(
                    f"{source}: num_hidden_layers={num_layers} does not divide by pp_size={P}; give each "
                    f"stage's layer count with ParallelConfig.pp_layers (--pp-layers), summing to {num_layers}"
                )
            counts = [num_layers // P] * P
        else:
            counts = list(self.pp_layers)
            if sum(counts) != num_layers:
                raise ConfigError(f"{source}: ParallelConfig.pp_layers={counts} sums to {sum(counts)} layers, "
                                  f"the model has num_hidden_layers={num_layers}")
        starts = [sum(counts[:s]) for s in range(P)]
        return [range(a, a + n) for a, n in zip(starts, counts)]

    def stage(self, index: int, num_layers: int) -> PipelineStage:
        return PipelineStage(index, self.pp_size, self.stage_layers(num_layers)[index])


MAX_PAGE_SIZE = 4096
MAX_REQUESTS = 1 << 16
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_TFLOPS = 1e6  # far above any accelerator
MAX_GB_PER_S = 1e6
MAX_MICROBATCHES = 4096


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
                              ("exchange", EXCHANGES)):
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
        self._check_kv_cache()

    def _check_kv_cache(self) -> None:
        """The sharded cache's ring needs the zigzag layout (its masks follow from the
        zigzag blocks) and eager attention breaks (point-to-point steps). LayerSplit
        fetches each layer's cached-prefix pages from the layer's owner in the attention
        break, with the live batch's page list: a full graph has no break."""
        if self.kv_cache != "sharded":
            if self.exchange != "auto":
                raise ConfigError(f"RuntimeConfig.exchange={self.exchange!r} needs kv_cache='sharded'; the "
                                  f"{self.kv_cache} cache all-gathers K/V (exchange='auto')")
            if self.kv_cache == "layer-split" and self.graph == "full":
                raise ConfigError(
                    "RuntimeConfig.graph='full' cannot run kv_cache='layer-split': a cached prefix's pages of each "
                    "layer are broadcast from the layer's owner in the attention break, sized by the live batch; "
                    "use graph='breakable'")
            return
        if self.layout != "zigzag":
            raise ConfigError(f"RuntimeConfig.kv_cache='sharded' runs the zigzag layout, got layout={self.layout!r}")
        if self.graph == "full":
            raise ConfigError(
                "RuntimeConfig.graph='full' cannot run kv_cache='sharded': the ring's point-to-point steps cannot be "
                "captured (NCCL send/recv under CUDA-graph capture is unsupported, pytorch #133984) and its per-step "
                "metadata changes with every batch; use graph='breakable' (the ring runs in the attention break)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
