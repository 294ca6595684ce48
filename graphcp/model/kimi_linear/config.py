"""Kimi Linear's settings (``KimiLinearForCausalLM``, Kimi K3's layout), read from a
config.json as transformers 5 reads it (``KimiLinearConfig``), validated up front; and the
parts a KDA hybrid shares (GLM-5-Next's text model reads them too: graphcp.model.glm5_next).

A layer (``layer_types[i]``) is

- ``linear_attention``: Kimi Delta Attention (docs/hybrid.md): q/k/v projections through
  causal depthwise convolutions of ``short_conv_kernel_size`` (SiLU), the forget gate's
  per-channel log decay (``f_a_proj`` / ``f_b_proj``, ``A_log``, ``dt_bias``), ``b_proj``'s
  beta, the delta rule per head, a gated RMSNorm (``g_a_proj`` / ``g_b_proj``, sigmoid) and
  ``o_proj``; ``num_heads`` heads of ``head_dim`` for q, k and v alike;
- ``full_attention``: MLA (``q_proj`` or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj``) with no positional encoding: the ``qk_rope_head_dim`` slice of each key is
  shared by the heads but never rotated.

The checkpoint's ``linear_attn_config`` gives the KDA heads and the layer kinds as
1-indexed ``kda_layers`` / ``full_attn_layers`` (used when ``layer_types`` is absent); the
MLP is dense in the ``first_k_dense_replace`` first layers (or as ``mlp_layer_types``
says) and DeepSeek's MoE elsewhere (sigmoid router with groups, a shared expert,
``routed_scaling_factor``). Kimi's checkpoints spell several keys their own way
(``num_experts``, ``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``,
``num_shared_experts``, ``model_max_length``); either spelling is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphcp.checks import check_bool, check_float, check_int
from graphcp.errors import ConfigError
from graphcp.model.config import ConfigReader, ModelConfig, decoder_config, read_head
from graphcp.model.hybrid.config import CONV_KERNELS, MAX_LINEAR_HEAD_DIM
from graphcp.model.hybrid.export import FULL, LINEAR
from graphcp.model.moe_config import MAX_EXPERTS, MAX_INTERMEDIATE, MoeConfig
from graphcp.model.rope import rope_from_hf

MAX_DIM = 1 << 16
#: Kimi's own spellings of transformers' keys (KimiLinearConfig.attribute_map): ours -> theirs
KIMI_ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
                "n_group": "num_expert_group", "num_local_experts": "num_experts",
                "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
#: transformers' KimiLinearConfig defaults for the keys read here
KIMI_DEFAULTS: dict[str, Any] = dict(
    moe_intermediate_size=1024, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, n_shared_experts=1,
    routed_scaling_factor=2.446, num_local_experts=256, linear_head_dim=128, linear_num_heads=32,
    linear_conv_kernel_dim=4, first_k_dense_replace=1, max_position_embeddings=1048576, rms_norm_eps=1e-5,
)
#: KimiLinearRMSNorm's default eps, which its q_a_layernorm and kv_a_layernorm keep
KIMI_LATENT_EPS = 1e-6


@dataclass(frozen=True)
class KdaConfig:
    """The KDA layers: which layers they are, their heads and convolution, the gate."""

    layer_kinds: tuple[str, ...]  # LINEAR / FULL per layer
    num_heads: int
    head_dim: int
    conv_kernel: int
    #: GLM-5-Next's bounded gate ``lower_bound * sigmoid(exp(A_log) g)``; None: Kimi's softplus
    lower_bound: float | None = None
    #: the convolution's weight is float32 whatever the model's dtype (GLM-5-Next keeps it so)
    conv_float32: bool = False

    def __post_init__(self) -> None:
        w = "KdaConfig"
        if self.conv_kernel not in CONV_KERNELS:
            raise ConfigError(f"{w}: short_conv_kernel_size={self.conv_kernel} is not supported; the convolution "
                              f"kernels take widths {', '.join(map(str, CONV_KERNELS))}")
        check_int(self.num_heads, "linear num_heads", lo=1, hi=MAX_DIM, where=w)
        check_int(self.head_dim, "linear head_dim", lo=1, hi=MAX_LINEAR_HEAD_DIM, where=w)
        if self.lower_bound is not None and not check_float(self.lower_bound, "linear_lower_bound", where=w) < 0:
            raise ConfigError(f"{w}: linear_lower_bound must be < 0 (a log decay's floor), got {self.lower_bound}")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == FULL)

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v of every head."""
        return 3 * self.qkv_dim


@dataclass(frozen=True)
class LatentConfig:
    """MLA without positional encoding (Kimi's full layers, GLM-5-Next's indexed ones)."""

    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # a key slice shared by the heads, never rotated (GLM-5-Next: 0)
    v_head_dim: int
    #: q_a_layernorm's and kv_a_layernorm's eps
    norm_eps: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What a token caches: the latent and the shared (unrotated) rope-slice key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5


@dataclass(frozen=True)
class KimiConfig:
    """Kimi Linear's settings (``ModelConfig.hybrid``)."""

    kda: KdaConfig
    latent: LatentConfig
    moe: MoeConfig | None
    prefix: str = "model."


class Keys:
    """A config's keys read with their defaults and aliases (``aliases``: our name ->
    the checkpoint's, either may be given, not both with different values)."""

    def __init__(self, d: dict[str, Any], source: str, defaults: dict[str, Any],
                 aliases: dict[str, str] | None = None) -> None:
        self.d, self.source, self.defaults, self.aliases = d, source, defaults, aliases or {}

    def raw(self, key: str) -> Any:
        other = self.aliases.get(key)
        a, b = self.d.get(key), self.d.get(other) if other else None
        if a is not None and b is not None and a != b:
            raise ConfigError(f"{self.source}: {key}={a!r} and {other}={b!r} disagree (one key, two spellings)")
        v = a if a is not None else b
        return self.defaults.get(key) if v is None else v

    def num(self, key: str, lo: int = 1, hi: int = MAX_DIM) -> int:
        v = self.raw(key)
        if v is None:
            raise ConfigError(f"{self.source}: missing required key {key!r}")
        return check_int(v, key, lo=lo, hi=hi, where=self.source)

    def opt_num(self, key: str, lo: int = 1, hi: int = MAX_DIM) -> int | None:
        v = self.raw(key)
        return None if v is None else check_int(v, key, lo=lo, hi=hi, where=self.source)

    def real(self, key: str, **kw) -> float:
        return check_float(self.raw(key), key, where=self.source, **kw)

    def flag(self, key: str) -> bool:
        return check_bool(self.raw(key), key, where=self.source)

    def resolved(self) -> dict[str, Any]:
        """The config with every aliased key under our name (what graphcp's shared readers read)."""
        d = dict(self.d)
        for ours, theirs in self.aliases.items():
            if d.get(ours) is None and d.get(theirs) is not None:
                d[ours] = d[theirs]
        return d


def kind_list(value: Any, key: str, num_layers: int, names: dict[str, str], source: str) -> tuple[str, ...]:
    """A per-layer list of ``key`` (``names``: its accepted values -> ours), checked."""
    if not isinstance(value, list) or len(value) != num_layers:
        n = len(value) if isinstance(value, list) else None
        raise ConfigError(f"{source}: {key} lists {n} entries, expected num_hidden_layers={num_layers}: "
                          f"{value!r}"[:300])
    bad = [v for v in value if v not in names]
    if bad:
        raise ConfigError(f"{source}: {key} entry {bad[0]!r} is not one of {sorted(names)}")
    return tuple(names[v] for v in value)


def layers_from_linear_attn_config(lac: dict, num_layers: int, source: str) -> tuple[str, ...]:
    """The layer kinds of ``linear_attn_config``'s 1-indexed ``kda_layers`` and
    ``full_attn_layers`` (as transformers reads them: ``layer_types[n - 1]``): every layer
    named exactly once."""
    kinds: list[str | None] = [None] * num_layers
    for key, kind in (("full_attn_layers", FULL), ("kda_layers", LINEAR)):
        entries = lac[key]
        if not isinstance(entries, list):
            raise ConfigError(f"{source}: linear_attn_config.{key} must be a list of layer numbers, got "
                              f"{entries!r}"[:300])
        for n in entries:
            check_int(n, f"linear_attn_config.{key} entry", lo=1, hi=num_layers, where=source)
            if kinds[n - 1] is not None:
                raise ConfigError(f"{source}: linear_attn_config names layer {n} twice (1-indexed; in "
                                  "kda_layers and full_attn_layers, or twice in one); each layer is one kind")
            kinds[n - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(f"{source}: linear_attn_config names neither kind for layer {missing[0]} (1-indexed) of "
                          f"{num_layers}; list every layer in kda_layers or full_attn_layers")
    return tuple(kinds)  # type: ignore[arg-type]


def kimi_layer_kinds(d: dict, num_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types``, else ``linear_attn_config``'s lists, else transformers' default
    (full attention at layers 4, 8, ...)."""
    if d.get("layer_types") is not None:
        return kind_list(d["layer_types"], "layer_types", num_layers,
                         {"linear_attention": LINEAR, "full_attention": FULL}, source)
    lac = linear_attn_config(d, source)
    if "full_attn_layers" in lac and "kda_layers" in lac:
        return layers_from_linear_attn_config(lac, num_layers, source)
    return tuple(FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers))


def linear_attn_config(d: dict, source: str) -> dict:
    lac = d.get("linear_attn_config")
    if lac is None:
        return {}
    if not isinstance(lac, dict):
        raise ConfigError(f"{source}: linear_attn_config must be an object, got {lac!r}"[:300])
    return lac


def kda_heads(k: Keys, lac: dict) -> tuple[int, int, int]:
    """The KDA heads, head dim and conv kernel: ``linear_attn_config``'s ``num_heads``,
    ``head_dim`` and ``short_conv_kernel_size`` over the top-level ``linear_*`` keys."""
    src = k.source

    def pick(inner: str, outer: str) -> int:
        v = lac.get(inner)
        name = f"linear_attn_config.{inner}"
        return k.num(outer, hi=MAX_DIM) if v is None else check_int(v, name, lo=1, hi=MAX_DIM, where=src)

    return pick("num_heads", "linear_num_heads"), pick("head_dim", "linear_head_dim"), \
        pick("short_conv_kernel_size", "linear_conv_kernel_dim")


def mlp_layers(k: Keys, num_layers: int, dense_default: int) -> tuple[int, ...]:
    """The sparse (MoE) layers: ``mlp_layer_types``, else the first ``first_k_dense_replace`` dense."""
    kinds = k.d.get("mlp_layer_types")
    if kinds is None:
        raw = k.d.get("first_k_dense_replace", dense_default)
        dense = min(check_int(raw, "first_k_dense_replace", lo=0, hi=1 << 20, where=k.source), num_layers)
        kinds = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    marks = kind_list(kinds, "mlp_layer_types", num_layers, {"dense": "dense", "sparse": "sparse"}, k.source)
    return tuple(i for i, m in enumerate(marks) if m == "sparse")


def sigmoid_moe(k: Keys, num_layers: int, dense_default: int) -> MoeConfig | None:
    """DeepSeek's MoE as these models configure it (None: every layer dense)."""
    layers = mlp_layers(k, num_layers, dense_default)
    if not layers:
        return None
    size = k.num("moe_intermediate_size", hi=MAX_INTERMEDIATE)
    experts = k.num("num_local_experts", hi=MAX_EXPERTS)
    top_k = k.num("num_experts_per_tok", hi=MAX_EXPERTS)
    if top_k > experts:
        raise ConfigError(f"{k.source}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    try:
        return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=size, scoring="sigmoid",
                         shared_intermediate_size=size * k.num("n_shared_experts", lo=0, hi=MAX_EXPERTS),
                         n_group=k.num("n_group", hi=MAX_EXPERTS), topk_group=k.num("topk_group", hi=MAX_EXPERTS),
                         norm_topk_prob=k.flag("norm_topk_prob"),
                         routed_scaling_factor=k.real("routed_scaling_factor", lo=0, lo_open=True), layers=layers)
    except ConfigError as e:
        raise ConfigError(f"{k.source}: {str(e).removeprefix('MoeConfig: ')}") from None


def latent_config(k: Keys, eps: float) -> LatentConfig:
    """MLA's sizes; its query and key heads are the attention heads (checked by the caller)."""
    return LatentConfig(k.opt_num("q_lora_rank"), k.num("kv_lora_rank"), k.num("qk_nope_head_dim"),
                        k.num("qk_rope_head_dim", lo=0), k.num("v_head_dim"), eps)


def check_latent_heads(d: dict, source: str) -> None:
    """MLA decompresses every head's keys and values: as many KV heads as query heads."""
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise ConfigError(f"{source}: num_key_value_heads={kv!r} must equal num_attention_heads={heads!r} (MLA: "
                          "every head decompresses its own keys and values from the latent)")


def kimi_a_log(kda: KdaConfig) -> tuple[int, ...]:
    """Kimi's ``A_log`` shape (``KimiLinearForgetGate``): ``[1, 1, H, 1]``."""
    return (1, 1, kda.num_heads, 1)


def even(n: int) -> int:
    """ModelConfig's head_dim sizes the generic attention buffers (these families attend
    through their own rows): the MLA head, made even as it requires."""
    return n + n % 2


def read_kimi(d: dict[str, Any], model_type: str, source: str) -> ModelConfig:
    """The ModelConfig of a Kimi Linear config.json."""
    k = Keys(d, source, KIMI_DEFAULTS, KIMI_ALIASES)
    resolved = k.resolved()
    for key in ("max_position_embeddings", "rms_norm_eps"):  # (transformers' defaults, not the shared reader's)
        if resolved.get(key) is None:
            resolved[key] = KIMI_DEFAULTS[key]
    resolved.pop("head_dim", None)  # (transformers' head_dim is the rope slice's: not a head's width here)
    r = ConfigReader(resolved, source)
    head = read_head(r)
    check_latent_heads(d, source)
    kinds = kimi_layer_kinds(d, head.num_layers, source)
    heads, dim, kernel = kda_heads(k, linear_attn_config(d, source))
    try:
        kda = KdaConfig(kinds, heads, dim, kernel)
    except ConfigError as e:
        raise ConfigError(f"{source}: {str(e).removeprefix('KdaConfig: ')}") from None
    latent = latent_config(k, KIMI_LATENT_EPS)
    moe = sigmoid_moe(k, head.num_layers, KIMI_DEFAULTS["first_k_dense_replace"])
    rope = rope_from_hf(resolved, source, head.max_positions)
    return decoder_config(r, model_type, head, rope, head_dim=even(latent.qk_head_dim), num_kv_heads=head.num_heads,
                          moe=moe, hybrid=KimiConfig(kda, latent, moe))
