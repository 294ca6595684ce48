"""Mixture-of-experts settings of a model, and reading them from a Hugging Face config.json.

Two families, read as transformers reads them:

- ``qwen3_moe`` (``Qwen3MoeForCausalLM``): ``num_experts`` (transformers 5 also writes
  it as ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``norm_topk_prob`` (default false), and the dense layers in between: layer ``i`` is
  sparse when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
  == 0``; the dense ones use ``intermediate_size``;
- ``mixtral`` (``MixtralForCausalLM``): ``num_local_experts``, ``num_experts_per_tok``,
  every layer sparse, ``intermediate_size`` is each expert's, top-k weights always
  renormalised.

Both route with a softmax over all experts (float32), then top-k. The router's kind
(``scoring``) picks the router class in ``graphcp/model/moe/router.py``: ``"sigmoid"``
is DeepSeek's (the DSA families, read in ``graphcp/model/dsa/config.py``): sigmoid scores,
``e_score_correction_bias`` for the choice only, the top-k within the ``topk_group``
best of ``n_group`` expert groups, weights scaled by ``routed_scaling_factor``.
``shared_intermediate_size`` sizes an optional dense shared expert added to the
routed output (DeepSeek's ``n_shared_experts`` experts as one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from graphcp.checks import check_bool, check_float, check_int
from graphcp.errors import ConfigError

MAX_EXPERTS = 1 << 16
MAX_INTERMEDIATE = 1 << 20
#: expert weight rows must be a multiple of 16 bytes for torch._grouped_mm: 8 elements
#: covers every float dtype (every released MoE model's expert sizes are multiples of 64)
GROUPED_ALIGN = 8
#: model_type -> the family's MoE reader below
MOE_FAMILIES = ("qwen3_moe", "mixtral")
#: each family's Hub checkpoint names: the MoE module and its expert projections (gate, up, down)
MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    layers: tuple[int, ...]  # the sparse layers (the others run the dense MLP)
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    shared_intermediate_size: int = 0  # 0: no shared expert
    #: the sigmoid router's group-limited choice and weight scale (softmax: 1, 1, 1.0)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    #: the top-k weights are cast to the model's dtype before the weighted sum (Qwen3-MoE)
    #: or stay float32 (Mixtral), as transformers does
    weights_in_model_dtype: bool = False

    def __post_init__(self) -> None:
        w = "MoeConfig"
        check_int(self.num_experts, "num_experts", lo=1, hi=MAX_EXPERTS, where=w)
        check_int(self.top_k, "num_experts_per_tok", lo=1, hi=self.num_experts, where=w)
        check_int(self.intermediate_size, "intermediate_size", lo=1, hi=MAX_INTERMEDIATE, where=w)
        check_int(self.shared_intermediate_size, "shared_intermediate_size", lo=0, hi=MAX_INTERMEDIATE, where=w)
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"{w}: scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        check_float(self.routed_scaling_factor, "routed_scaling_factor", lo=0, lo_open=True, where=w)
        check_int(self.n_group, "n_group", lo=1, hi=self.num_experts, where=w)
        if self.num_experts % self.n_group:
            raise ConfigError(f"{w}: num_experts={self.num_experts} does not divide into n_group={self.n_group} "
                              "expert groups")
        if self.scoring == "sigmoid" and self.num_experts // self.n_group < 2:
            raise ConfigError(f"{w}: each of the n_group={self.n_group} expert groups needs >= 2 experts (a group "
                              f"scores by its top two); num_experts={self.num_experts}")
        check_int(self.topk_group, "topk_group", lo=1, hi=self.n_group, where=w)
        check_int(self.top_k, "num_experts_per_tok", lo=1, hi=self.topk_group * (self.num_experts // self.n_group),
                  where=w)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.layers

    def check_parallel(self, cp_size: int, layout: str, source: str, hidden_size: int,
                       degree: str = "cp_size", flags: bool = False) -> None:
        """Refuse a split of the experts over ``cp_size`` ranks that does not divide, and
        sizes the grouped matmuls cannot take (``layout``: RuntimeConfig.moe, checked there).
        ``cp_size``: the ranks the experts split over (the stage's tp_size); ``degree``: its
        name in the messages (cp_size without attention TP or DP, else tp_size; with
        ``flags``, the flag: --cp or --tp)."""
        ranks = f"{degree} {cp_size}" if flags else f"{degree}={cp_size}"

        def moe(value: str) -> str:  # the MoE layout as the API or the command line says it
            return f"--moe {value}" if flags else f"moe={value!r}"

        if hidden_size % GROUPED_ALIGN:
            raise ConfigError(f"{source}: hidden_size={hidden_size} of a mixture-of-experts model must be a multiple "
                              f"of {GROUPED_ALIGN} (the grouped expert matmuls need 16-byte rows)")
        if layout == "ep" and self.num_experts % cp_size:
            raise ConfigError(
                f"{source}: num_experts={self.num_experts} does not divide by {ranks}; "
                f"{'--moe ep' if flags else 'RuntimeConfig.moe=' + repr('ep')} gives each rank num_experts / {degree} "
                f"contiguous experts (use {moe('tp')}, or a degree that divides {self.num_experts})"
            )
        if layout != "ep" and self.intermediate_size % cp_size:
            raise ConfigError(
                f"{source}: the experts' intermediate size {self.intermediate_size} does not divide by "
                f"{ranks}; {'--moe tp' if flags else 'RuntimeConfig.moe=' + repr('tp')} shards every expert over "
                f"the TP ranks (use {moe('ep')})"
            )
        per_rank = self.intermediate_size // (1 if layout == "ep" else cp_size)
        if per_rank % GROUPED_ALIGN:
            raise ConfigError(
                f"{source}: each rank's expert intermediate size is {per_rank} ({moe(layout)}, {ranks}); "
                f"the grouped expert matmuls (torch._grouped_mm) need a multiple of {GROUPED_ALIGN} (16-byte rows)"
            )
        if self.shared_intermediate_size % cp_size:
            raise ConfigError(f"{source}: shared_intermediate_size={self.shared_intermediate_size} does not "
                              f"divide by {ranks}; the shared expert is sharded like the dense MLP")


def moe_from_hf(d: dict[str, Any], family: str, num_layers: int, source: str) -> MoeConfig | None:
    """The MoE settings of a config.json of ``family`` (None for a dense family, or a
    Qwen3-MoE config with no experts); ConfigError naming the key otherwise."""
    if family not in MOE_FAMILIES:
        return None

    def num(key: str, default: Any, lo: int = 1, hi: int = MAX_EXPERTS) -> int:
        v = d.get(key)
        return default if v is None else check_int(v, key, lo=lo, hi=hi, where=source)

    experts = num("num_local_experts", None, lo=0)
    if family == "qwen3_moe":
        alias = num("num_experts", None, lo=0)
        if experts is not None and alias is not None and experts != alias:
            raise ConfigError(f"{source}: num_experts={alias} and num_local_experts={experts} disagree")
        experts = experts if experts is not None else (alias if alias is not None else 128)
        if experts == 0:  # transformers builds every layer dense then
            return None
        step = num("decoder_sparse_step", 1, hi=max(1, num_layers))
        only = d.get("mlp_only_layers")
        only = [] if only is None else only
        if not isinstance(only, list):
            raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}"[:300])
        dense = {check_int(i, "mlp_only_layers entry", lo=0, hi=num_layers - 1, where=source) for i in only}
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        size = num("moe_intermediate_size", 768, hi=MAX_INTERMEDIATE)
        norm = d.get("norm_topk_prob")
        norm = False if norm is None else check_bool(norm, "norm_topk_prob", where=source)
        top_k = num("num_experts_per_tok", 8)
    else:  # mixtral: every layer sparse, each expert as large as intermediate_size
        experts = 8 if experts is None else experts
        if experts == 0:
            raise ConfigError(f"{source}: num_local_experts must be >= 1, got 0")
        layers = tuple(range(num_layers))
        size = num("intermediate_size", 14336, hi=MAX_INTERMEDIATE)
        norm = True
        top_k = num("num_experts_per_tok", 2)
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    if not layers:
        return None
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=size, norm_topk_prob=norm, layers=layers,
                     weights_in_model_dtype=family == "qwen3_moe")
