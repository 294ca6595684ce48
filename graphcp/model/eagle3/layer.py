"""The EAGLE-3 draft model: ``fc`` over the target's concatenated hidden states, one
decoder layer (``midlayer``) whose q/k/v read ``[input_layernorm(embed(ids)),
hidden_norm(fc(h))]``, the residual from ``fc``'s output, the final ``norm`` and an LM
head over the draft vocabulary (``d2t``: target id = draft id + d2t[draft id]).

Per rank, on this rank's rows only, with the target's CP layout: the rows' K/V join
the cache as one more layer (``layer_index``, after the target's) through the same
store and attention break as any layer; the MLP is whole on every rank (one small
layer: no collective). The embedding is the target's."""

from __future__ import annotations

import torch
from torch import nn

from graphcp.model.cp_attention import begin_forward
from graphcp.model.eagle3.config import Eagle3Config
from graphcp.model.forward_context import ForwardContext
from graphcp.model.layers import ParallelMLP, RMSNorm, Rotary
from graphcp.model.llama import Attention


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, layer_index: int, embed: nn.Embedding, dtype: torch.dtype,
                 max_positions: int) -> None:
        super().__init__()
        c = cfg.layer
        h = c.hidden_size
        self.cfg, self.layer_index, self.dtype = cfg, layer_index, dtype
        self.embed = [embed]  # the target's (a list: not a submodule, never loaded or moved here)
        self.fc = nn.Linear(3 * h, h, bias=cfg.fc_bias, dtype=dtype)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, layer_index, dtype)
        # q/k/v read the concatenated embedding and hidden rows: 2H inputs
        self.self_attn.qkv = nn.Linear(2 * h, c.q_size + 2 * c.kv_size, bias=False, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.mlp = ParallelMLP(h, c.intermediate_size, 1, False, dtype)  # whole: tp 1
        self.norm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.rotary = Rotary(c.head_dim, max_positions, c.rope)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    @property
    def draft_to_target(self) -> torch.Tensor:
        """int64 [draft_vocab]: the target id of each draft id (``arange + d2t``)."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows: ``input_ids`` (the shifted ids), ``positions`` and ``hidden``
        ([rows, 3 * hidden], the target's states of the same rows) -> the normed rows the
        LM head reads, and the rows before the norm (what a next draft step takes).
        ``own``: ``hidden`` is [rows, hidden], the draft's own rows before its norm (a
        proposal after the first, where the target has not run yet): they replace ``fc``'s."""
        begin_forward(ctx)
        x = hidden if own else self.fc(hidden)
        a = torch.cat([self.input_layernorm(self.embed[0](input_ids)), self.hidden_norm(x)], dim=-1)
        h = x + self.self_attn(a, positions, self.rotary, ctx)
        pre = h + self.mlp.partial(self.post_attention_layernorm(h))
        return self.norm(pre), pre

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [n, draft_vocab]."""
        return torch.matmul(rows, self.lm_head.weight.t()).float()
