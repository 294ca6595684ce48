"""Model, parallel and runtime configs, validated up front.

Configs are frozen: everything that shapes a forward (and so a captured graph)
is decided before the first batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: HF ``architectures`` entries (and ``model_type`` fallbacks) this decoder covers
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    pass


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 [head_dim // 2] inverse frequencies, llama3 scaling applied; computed
        in the same order of operations as transformers so the tables agree bitwise."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "llama3":
            low_wl = self.original_max_position_embeddings / self.low_freq_factor
            high_wl = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            scaled = torch.where(wavelen > low_wl, inv / self.factor, inv)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            mid = ~(wavelen < high_wl) * ~(wavelen > low_wl)
            inv = torch.where(mid, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2 | qwen3
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
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
            if family not in SUPPORTED_ARCHITECTURES.values():
                raise ConfigError(
                    f"{source}: no architectures entry and unsupported model_type {family!r}; "
                    f"graphcp supports {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        window = d.get("sliding_window")
        use_window = d.get("use_sliding_window", family == "mistral")
        if window is not None and use_window and window < d.get("max_position_embeddings", 0):
            raise ConfigError(
                f"{source}: sliding_window={window} attention is not supported (graphcp attends the full context)"
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = _rope_from_hf(d)
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=family != "qwen2" and bool(d.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                mlp_bias=bool(d.get("mlp_bias", False)),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required key {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(p))


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta + rope_scaling
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ConfigError(f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")


@dataclass(frozen=True)
class ParallelConfig:
    """CP and TP degrees. The graph path needs PP = 1 and CP = TP (the MLP is
    tensor-parallel over the CP group)."""

    cp_size: int = 1
    tp_size: int | None = None  # None: equal to cp_size
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ConfigError(f"cp_size must be >= 1, got {self.cp_size}")
        if self.tp_size is None:
            object.__setattr__(self, "tp_size", self.cp_size)
        if self.pp_size != 1:
            raise ConfigError(f"pp_size={self.pp_size}: graphcp runs with PP = 1 only")
        if self.tp_size != self.cp_size:
            raise ConfigError(
                f"tp_size={self.tp_size} != cp_size={self.cp_size}: graphcp runs the MLP tensor-parallel "
                "over the CP group, so TP must equal CP"
            )

    def check_model(self, m: ModelConfig) -> None:
        """Reject a model whose sharded sizes do not divide by the TP degree."""
        if m.intermediate_size % self.tp_size:
            raise ConfigError(
                f"intermediate_size={m.intermediate_size} does not divide by tp_size=cp_size={self.tp_size}; "
                "the MLP is column/row-parallel over the CP group"
            )


@dataclass(frozen=True)
class RuntimeConfig:
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    #: KV pool size in tokens (rounded up to pages); None: enough for max_position_embeddings x 4
    kv_tokens: int | None = None
    attention: str = "torch"  # torch | triton | flashinfer | trtllm | auto
    graph: str = "off"  # off | breakable | full
    graph_backend: str = "auto"  # auto | cuda | trace
    layout: str = "zigzag"  # zigzag | interleave
    #: requests a captured body holds (static segment metadata capacity)
    max_requests: int = 64
    debug_graphs: bool = False
    #: replay each new bucket once on a synthetic batch and compare it bitwise with the
    #: same-bucket eager body (CaptureError on a difference); None: on for the trace
    #: graph backend, off for cuda (where it costs about two forwards per bucket)
    verify_capture: bool | None = None
    check_consistency: bool = True
    collective_timeout_s: float = 300.0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.graph not in ("off", "breakable", "full"):
            raise ConfigError(f"graph must be off|breakable|full, got {self.graph!r}")
        if self.graph_backend not in ("auto", "cuda", "trace"):
            raise ConfigError(f"graph_backend must be auto|cuda|trace, got {self.graph_backend!r}")
        if self.layout not in ("zigzag", "interleave"):
            raise ConfigError(f"layout must be zigzag|interleave, got {self.layout!r}")
        if self.max_requests < 1:
            raise ConfigError(f"max_requests must be >= 1, got {self.max_requests}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
