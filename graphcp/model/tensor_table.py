"""A checkpoint's tensor table: where each Hub tensor lands in a model on one rank.

A family's table (:meth:`graphcp.model.family.ModelFamily.tensor_table`) maps every
tensor name the checkpoint must hold to a :class:`TensorTarget`; the loader
(:mod:`graphcp.model.loader`) checks every shape against it and reads only what this
rank keeps. The helpers build the parts several families share: a TP-sharded SwiGLU
MLP and the routed experts of a MoE layer in either layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from graphcp.options import MoeLayout

#: a decoder layer's tensor, for telling the MTP layers (index >= num_hidden_layers) apart
LAYER = re.compile(r"model\.layers\.(\d+)\.")
#: DeepSeek V4's multi-token-prediction tensors (transformers skips them too)
MTP = "mtp."


def is_skipped(name: str, num_layers: int) -> bool:
    """A tensor of a layer graphcp does not run: multi-token prediction, as DeepSeek V3.2
    and GLM-5 ship it (layers past ``num_hidden_layers``) and DeepSeek V4 (``mtp.*``)."""
    hit = LAYER.match(name)
    return (hit is not None and int(hit.group(1)) >= num_layers) or name.startswith(MTP)


@dataclass(frozen=True)
class TensorTarget:
    param: str  # our parameter name
    dim: int  # the parameter dim the slice runs along
    start: int  # where the slice lands along it
    shard: tuple[int, int, int] | None  # (dim, start, length) read from the checkpoint tensor; None: whole
    shape: tuple[int, ...]  # the checkpoint tensor's full shape
    float32: bool = False  # stored in float32 whatever the checkpoint's dtype
    index: int | None = None  # lands in ``param[index]`` (a local expert), then as above
    read: bool = True  # False: another rank's expert (its shape is checked, it is not read)
    integer: bool = False  # an integer table (DeepSeek V4's tid2eid), not a weight
    #: more slices of the same checkpoint tensor that land elsewhere (each its own param,
    #: dim, start and shard: a hybrid's fused q/k/v rows of this rank's heads, three runs)
    parts: tuple["TensorTarget", ...] = ()


def expert_targets(hf: str, me: str, num_experts: int, size: int, h: int, rank: int, tp: int,
                    moe: MoeLayout, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                    ) -> dict[str, TensorTarget]:
    """The routed experts' tensors into SparseMoeBlock's stacked ``gate_up [E_local, 2 I,
    h]`` / ``down [E_local, h, I]``: ``ep``: this rank's experts whole (the others'
    checked, not read); ``tp``: each expert's ``I / C`` slice."""
    t = {}
    gate_up, down = me + "gate_up", me + "down"
    g, u, d = names
    if moe == "ep":
        local = num_experts // tp
        for e in range(num_experts):
            mine, i = e // local == rank, e % local
            t[f"{hf}{e}.{g}.weight"] = TensorTarget(gate_up, 0, 0, None, (size, h), index=i, read=mine)
            t[f"{hf}{e}.{u}.weight"] = TensorTarget(gate_up, 0, size, None, (size, h), index=i, read=mine)
            t[f"{hf}{e}.{d}.weight"] = TensorTarget(down, 0, 0, None, (h, size), index=i, read=mine)
        return t
    s = size // tp
    rows = (0, rank * s, s)
    for e in range(num_experts):
        t[f"{hf}{e}.{g}.weight"] = TensorTarget(gate_up, 0, 0, rows, (size, h), index=e)
        t[f"{hf}{e}.{u}.weight"] = TensorTarget(gate_up, 0, s, rows, (size, h), index=e)
        t[f"{hf}{e}.{d}.weight"] = TensorTarget(down, 1, 0, (1, rank * s, s), (h, size), index=e)
    return t


def sharded_mlp(hf: str, me: str, size: int, h: int, rank: int, tp: int,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict[str, TensorTarget]:
    """A SwiGLU MLP of ``size`` sharded over tp ranks (ParallelMLP's fused gate_up, down)."""
    s = size // tp
    rows = (0, rank * s, s)
    g, u, d = names
    return {hf + f"{g}.weight": TensorTarget(me + "gate_up.weight", 0, 0, rows, (size, h)),
            hf + f"{u}.weight": TensorTarget(me + "gate_up.weight", 0, s, rows, (size, h)),
            hf + f"{d}.weight": TensorTarget(me + "down.weight", 1, 0, (1, rank * s, s), (h, size))}
