"""The model's config (``config.json``), validated up front: the decoder's sizes and RoPE
(:mod:`graphcp.model.rope`) that every family shares, and the family's own settings
(mixture-of-experts, :mod:`graphcp.model.moe_config`; DSA's and DeepSeek V4's, in their
packages). Which family reads a config is the registry's choice (graphcp.model.family):
:meth:`ModelConfig.from_hf_dict` asks it, and the family reads the file with
:class:`ConfigReader`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcp.checks import MAX_TOKENS, check_bool, check_float, check_int, check_str
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.config import MAX_LAYERS, ParallelConfig, RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.family import family_named, supported_architectures
from graphcp.model.moe_config import MoeConfig
from graphcp.model.rope import RopeConfig
from graphcp.options import MoeLayout

#: sane upper bounds on model sizes (far above any real checkpoint)
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_POSITIONS = 1 << 24  # the RoPE tables hold every position


@dataclass(frozen=True)
class ModelConfig:
    family: str  # the model_type (llama, qwen3, deepseek_v32, ...): its family reads it (graphcp.model.family)
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
    #: the DSA family's settings (graphcp.model.dsa.config.DsaConfig: MLA + the indexer +
    #: DeepSeek MoE); None for other families. Read by its package only. DSA models set
    #: num_kv_heads = num_heads and head_dim = qk_rope_head_dim (RoPE's width)
    dsa: Any = None
    #: DeepSeek V4's settings (graphcp.model.dsv4.config.DsV4Config: layer kinds,
    #: compressors, indexer, mHC and MoE); None for other families. Read by its package
    #: only. V4 models set num_kv_heads = 1 and intermediate_size = moe_intermediate_size
    dsv4: Any = None
    #: a linear-attention hybrid's settings (graphcp.model.hybrid.config.HybridConfig: the
    #: layer kinds, the Gated DeltaNet heads and convolution, the partial RoPE; a KDA
    #: hybrid's: graphcp.model.kimi_linear.config.KimiConfig);
    #: None for other families. Read by its package only
    hybrid: Any = None

    def __post_init__(self) -> None:
        w = "ModelConfig"
        for name, hi in (("vocab_size", MAX_VOCAB), ("hidden_size", MAX_HIDDEN),
                         ("intermediate_size", MAX_INTERMEDIATE),
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
        and what was expected. The family that reads it is chosen once, by its
        ``architectures`` entry (or ``model_type``): graphcp.model.family."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object (the model's config), got {type(d).__name__}")
        model_type = model_type_of(d, source)
        return family_named(model_type).read_config(d, model_type, source)

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

    @property
    def kind(self) -> str:
        """What graphcp/combinations.py's model axis calls this model (its family says)."""
        return family_named(self.family).kind(self)

    def check_combination(self, runtime: RuntimeConfig, parallel: ParallelConfig, attention: str | None = None,
                          flags: bool = False) -> None:
        """Refuse options that do not combine for this model (graphcp/combinations.py: a
        DSA model with the sharded cache, a MoE model's ``ep`` layout in a full graph, ...);
        ``attention``: the backend ``auto`` stands for on the device (None: as configured);
        ``flags``: name the command-line flags."""
        settings = {**runtime_settings(runtime), **parallel_settings(parallel), "model": self.kind,
                    "moe": runtime.moe}
        if attention is not None:
            settings["attention"] = attention
        check_combination(settings, flags, self.family)

    def check_parallel(self, parallel: ParallelConfig, source: str = "the model", moe: MoeLayout = "ep",
                       flags: bool = False) -> None:
        """Refuse this model under ``parallel`` when its sharded sizes do not divide (its
        family's checks: heads over attention TP, intermediate sizes and experts over the
        FFN's TP degree, layers into the pipeline stages); ``flags``: name the flags."""
        family_named(self.family).check_parallel(self, parallel, source, moe, flags)


def model_type_of(d: dict[str, Any], source: str) -> str:
    """The model type a config.json names: its first ``architectures`` entry's, or its
    ``model_type`` without one; ConfigError for one no registered family reads."""
    supported = supported_architectures()
    archs = d.get("architectures")
    archs = [] if archs is None else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: architectures must be a list of class names, got {archs!r}"[:300])
    if archs:
        unsupported = [a for a in archs if a not in supported]
        if unsupported:
            raise ConfigError(f"{source}: unsupported architectures entry {unsupported[0]!r}; "
                              f"graphcp supports {sorted(supported)}")
        return supported[archs[0]]
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in supported.values():
        raise ConfigError(f"{source}: no architectures entry and unsupported model_type {model_type!r}; "
                          f"graphcp supports {sorted(supported)}")
    return model_type


class ConfigReader:
    """Reads one config.json's keys, checked and named (a family's ``read_config`` uses it)."""

    def __init__(self, d: dict[str, Any], source: str) -> None:
        self.d, self.source = d, source

    def num(self, key: str, hi: int, default: Any = ...) -> int:
        """An integer key in [1, hi]; a missing key takes its default, an optional key set
        to null too (as transformers); a missing required one is a ConfigError."""
        d = self.d
        if key not in d or (d[key] is None and default is not ...):
            if default is ...:
                raise ConfigError(f"{self.source}: missing required key {key!r}")
            return default
        return check_int(d[key], key, lo=1, hi=hi, where=self.source)

    def flag(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        return default if v is None else check_bool(v, key, where=self.source)


@dataclass(frozen=True)
class DecoderHead:
    """What every family reads first, in this order (a config's first bad key is the one
    named): the activation, the context, a sliding window, heads and sizes, the layers."""

    max_positions: int | None
    num_heads: int
    hidden_size: int
    head_dim: int
    eps: Any
    torch_dtype: str | None
    attention_bias: bool
    num_layers: int


def read_head(r: ConfigReader, window_by_default: bool = False) -> DecoderHead:
    """The keys every family reads before its own (see :class:`DecoderHead`);
    ``window_by_default``: the family uses its ``sliding_window`` unless told not to."""
    d, source = r.d, r.source
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    max_pos = r.num("max_position_embeddings", MAX_POSITIONS, None)
    window = d.get("sliding_window")
    if window is not None:
        window = check_int(window, "sliding_window", lo=0, hi=MAX_TOKENS, where=source)
    use_window = r.flag("use_sliding_window", window_by_default)
    if window is not None and use_window and window < (max_pos or 0):
        raise ConfigError(
            f"{source}: sliding_window={window} attention is not supported (graphcp attends the full context)"
        )
    heads = r.num("num_attention_heads", MAX_HEADS)
    hidden = r.num("hidden_size", MAX_HIDDEN)
    head_dim = r.num("head_dim", MAX_HEAD_DIM, None)
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
    attention_bias = r.flag("attention_bias", False)
    return DecoderHead(max_pos, heads, hidden, head_dim, eps, dtype, attention_bias,
                       r.num("num_hidden_layers", MAX_LAYERS))


def decoder_config(r: ConfigReader, model_type: str, head: DecoderHead, rope: RopeConfig, *,
                   intermediate_size: int | None = None, num_kv_heads: int | None = None,
                   head_dim: int | None = None, attention_bias: bool | None = None, o_bias: bool | None = None,
                   qk_norm: bool = False, moe: Any = None, **family: Any) -> ModelConfig:
    """The ModelConfig of a family's read: the remaining shared keys, in order, with the
    family's overrides (None: as the file says) and its own settings (``family``: dsa=...)."""
    source = r.source
    attention_bias = head.attention_bias if attention_bias is None else attention_bias
    return ModelConfig(
        family=model_type,
        vocab_size=r.num("vocab_size", MAX_VOCAB),
        hidden_size=head.hidden_size,
        intermediate_size=(r.num("intermediate_size", MAX_INTERMEDIATE) if intermediate_size is None
                           else intermediate_size),
        num_layers=head.num_layers,
        num_heads=head.num_heads,
        num_kv_heads=r.num("num_key_value_heads", MAX_HEADS, head.num_heads) if num_kv_heads is None else num_kv_heads,
        head_dim=head.head_dim if head_dim is None else head_dim,
        rms_norm_eps=1e-6 if head.eps is None else check_float(head.eps, "rms_norm_eps", lo=0.0, hi=1.0,
                                                               where=source),
        rope=rope,
        max_position_embeddings=4096 if head.max_positions is None else head.max_positions,
        tie_word_embeddings=r.flag("tie_word_embeddings", False),
        attention_bias=attention_bias,
        o_bias=head.attention_bias if o_bias is None else o_bias,
        qk_norm=qk_norm,
        mlp_bias=r.flag("mlp_bias", False),
        torch_dtype=head.torch_dtype,
        moe=moe(r) if callable(moe) else moe,
        **family,
    )
