"""The model's config (``config.json``), validated up front: the decoder's sizes, RoPE
(:mod:`graphcp.model.rope`), mixture-of-experts (:mod:`graphcp.model.moe_config`) and
DSA settings (:mod:`graphcp.model.dsa_config`), and the architectures graphcp runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcp.checks import MAX_TOKENS, check_bool, check_float, check_int, check_str
from graphcp.combinations import check as check_combination
from graphcp.combinations import model_kind, parallel_settings, runtime_settings
from graphcp.config import MAX_LAYERS, ParallelConfig, RuntimeConfig
from graphcp.errors import ConfigError
from graphcp.model.dsa_config import DsaConfig, dsa_from_hf
from graphcp.model.dsv4_config import DsV4Config, dsv4_from_hf
from graphcp.model.moe_config import MoeConfig, moe_from_hf
from graphcp.model.rope import RopeConfig, rope_from_hf
from graphcp.options import MoeLayout

#: HF ``architectures`` entries (and ``model_type`` fallbacks) this decoder covers
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    # DeepSeek Sparse Attention models (graphcp/model/dsa_config.py, graphcp/model/dsa/)
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    # DeepSeek V4 (graphcp/model/dsv4_config.py, graphcp/model/dsv4/)
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
#: sane upper bounds on model sizes (far above any real checkpoint)
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_HEADS = 4096
MAX_HEAD_DIM = 4096
MAX_POSITIONS = 1 << 24  # the RoPE tables hold every position


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | deepseek_v32 | glm_moe_dsa | deepseek_v4
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
    #: DeepSeek V4's layer kinds, compressors, indexer, mHC and MoE; None for other families.
    #: V4 models set num_kv_heads = 1 and intermediate_size = moe_intermediate_size
    dsv4: DsV4Config | None = None

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
        dsv4 = dsv4_from_hf(d, family, num_layers, max_pos, source)
        rope = rope_from_hf(d, source, max_pos) if dsv4 is None else dsv4.main_rope
        dsa = dsa_from_hf(d, family, num_layers, rope, source)
        return cls(
            family=family,
            vocab_size=num("vocab_size", MAX_VOCAB),
            hidden_size=hidden,
            intermediate_size=(num("intermediate_size", MAX_INTERMEDIATE) if dsv4 is None
                               else dsv4.moe_intermediate_size),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=num("num_key_value_heads", MAX_HEADS, heads) if dsv4 is None else 1,
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
            dsv4=dsv4,
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

    @property
    def kind(self) -> str:
        """What graphcp/combinations.py calls this model: dense, moe or dsa."""
        return "dsv4" if self.dsv4 is not None else model_kind(self.dsa is not None, self.moe is not None)

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

    def check_parallel(self, parallel: ParallelConfig, source: str = "the model", moe: MoeLayout = "ep") -> None:
        """Refuse this model under ``parallel`` when its sharded sizes do not divide by the
        FFN's TP degree (``tp_size``: with mixture-of-experts layers, its experts must split
        over the T ranks as ``moe`` asks, :meth:`MoeConfig.check_parallel`), its heads do
        not split over attention TP, or its layers do not split into the pipeline stages
        (meshes graphcp has not built, e.g. attention DP with stages, are refused as
        combinations: :meth:`check_combination`)."""
        m, T = self, parallel.tp_size
        # DeepSeek's MoE lives in m.dsa, V4's in m.dsv4 (every V4 layer is a MoE layer)
        for experts in (m.moe, m.dsa.moe if m.dsa is not None else None, m.dsv4.moe if m.dsv4 is not None else None):
            if experts is not None:
                experts.check_parallel(T, moe, source, m.hidden_size, "cp_size" if T == parallel.cp_size else "tp_size")
        dense = (m.dsa.has_dense_layers(m.num_layers) if m.dsa is not None else False if m.dsv4 is not None
                 else m.has_dense_mlp)
        if dense and m.intermediate_size % T:
            degree = f"tp_size=cp_size={T}" if T == parallel.cp_size else f"tp_size={T}"
            raise ConfigError(
                f"{source}: intermediate_size={m.intermediate_size} does not divide by {degree}; the MLP is "
                "column/row-parallel over the stage's tp_size ranks"
            )
        self._check_heads(parallel.attn_tp_size, source)
        parallel.stage_layers(m.num_layers, source)

    def _check_heads(self, size: int, source: str) -> None:
        """Heads split over attention TP ``size`` (graphcp.model.heads): query heads evenly,
        KV heads evenly or replicated when fewer than the ranks; DSA keeps attention TP 1."""
        if size == 1:
            return
        if self.dsa is not None:  # refused as the combination it is (graphcp/combinations.py)
            check_combination({"model": "dsa", "attn_tp": ">1"}, family=self.family)
        if self.num_heads % size:
            raise ConfigError(f"{source}: num_attention_heads={self.num_heads} does not divide by attention TP "
                              f"{size} (tp_size / (cp_size x dp_size)): change tp_size or cp_size")
        if self.dsv4 is not None and self.dsv4.o_groups % size:  # a rank projects its heads' whole groups
            raise ConfigError(f"{source}: o_groups={self.dsv4.o_groups} does not divide by attention TP {size} "
                              "(tp_size / (cp_size x dp_size)): change tp_size or cp_size")
        kv = self.num_kv_heads
        if kv % size and size % kv:
            raise ConfigError(f"{source}: num_key_value_heads={kv} neither divides by attention TP {size} nor "
                              "divides it (KV heads split, or replicate when fewer than the ranks): change tp_size "
                              "or cp_size")
