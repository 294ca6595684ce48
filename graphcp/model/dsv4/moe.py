"""DeepSeek V4's MoE: every layer's FFN, routed experts plus one shared expert, the
SwiGLU of both clamped at ``swiglu_limit``.

Routing (``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``): the gate's logits in the
model's dtype, scores by ``scoring_func`` (sqrt(softplus), sigmoid or softmax); the
experts chosen by the scores plus ``e_score_correction_bias`` (top-k), or, in a
``hash_moe`` layer, by the token's id (``tid2eid[token]``, a frozen table); weights the
chosen experts' scores renormalised, times ``routed_scaling_factor``.

Each rank routes its own rows (a hash layer with its own tokens' ids), so the choice
never needs another rank's tokens; then the layouts of ``graphcp/model/moe/block.py``:
``tp`` gathers rows, choices and weights over the T ranks, ``ep`` dispatches the rows
to the experts' ranks (the exchange, in a graph break).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.model.communicator import LayerCommunicator
from graphcp.model.dsv4.config import DsV4Config
from graphcp.model.layers import ParallelMLP
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe.ep import ep_forward
from graphcp.model.moe.experts import Experts, routed_experts
from graphcp.model.moe.router import ascending
from graphcp.options import MoeLayout

SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


class V4Router(nn.Module):
    def __init__(self, cfg: DsV4Config, hidden: int, vocab: int, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hashed = cfg.num_experts, cfg.top_k, hashed
        self.scale, self.score = cfg.routed_scaling_factor, SCORE_FNS[cfg.scoring_func]
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=dtype), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(vocab, cfg.top_k, dtype=torch.int64), requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x [n, hidden]`` of tokens ``token_ids [n]`` -> ascending ``ids [n, k]``, ``weights [n, k]``."""
        scores = self.score(F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid.index_select(0, token_ids)
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ascending(ids, weights * self.scale)


class V4MoeBlock(SparseMoeBlock):
    """A SparseMoeBlock (the layouts, the stats, the capture rules) with V4's router,
    clamped experts and shared expert; forward takes the rows' token ids."""

    def __init__(self, cfg: DsV4Config, hidden: int, vocab: int, hashed: bool, layout: MoeLayout, rank: int,
                 group_size: int, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.layout, self.num_experts = layout, cfg.num_experts
        self.router = V4Router(cfg, hidden, vocab, hashed, dtype)
        size, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        if layout == "ep":
            local = cfg.num_experts // group_size
            self.experts = Experts(local, hidden, size, rank * local, dtype, limit)
        else:
            self.experts = Experts(cfg.num_experts, hidden, size // group_size, 0, dtype, limit)
        self.shared = ParallelMLP(hidden, size, group_size, False, dtype, limit)

    def forward(self, x: torch.Tensor, group, token_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``tp``: this rank's rows routed here, then rows, choices and weights gathered."""
        comm = LayerCommunicator.of(group)
        ids, weights = self.router(x, token_ids)
        rows = comm.enter_ffn(x)
        routed = routed_experts(rows, comm.enter_ffn(ids), comm.enter_ffn(weights), self.experts)
        return comm.leave_ffn(routed) + self.shared(x, comm)

    def forward_ep(self, x: torch.Tensor, live: int, group, stats: dict | None = None,  # type: ignore[override]
                   token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``ep``: the live rows routed here and dispatched to their experts' ranks."""
        comm = LayerCommunicator.of(group)
        ids, weights = self.router(x[:live], token_ids[:live])
        routed = ep_forward(x[:live], lambda rows: (ids, weights), self.experts, comm.ffn, self.num_experts, stats)
        out = self.shared(x, comm)
        out[:live] += routed
        return out
