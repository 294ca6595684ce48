"""One decoder for the Llama family: Llama (incl. llama3 RoPE scaling), Mistral,
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim), and the
mixture-of-experts Qwen3-MoE and Mixtral (a sparse MoE block in place of the MLP in
the layers ``MoeConfig.layers`` names; ``graphcp/model/moe/``).

Per layer, on this rank's rows only:
  norm -> fused qkv -> (q/k norm) -> RoPE -> KV exchange + cache write
  -> attention (a graph break) -> o_proj -> residual -> norm -> MLP -> residual
Attention heads are split over attention TP (``graphcp/model/heads.py``: q/k/v
column-parallel, o_proj row-parallel, its partial sums all-reduced); the MLP is
sharded over the stage's T ranks, the layer communicator (``communicator.py``) moving
the rows between the layouts. Attention TP 1: whole attention weights, TP = CP.
A layer whose experts are split over the ranks (``RuntimeConfig.moe="ep"``) runs
attention, o_proj, the residual, the norm and the MoE exchange in one graph break
(the exchange's split sizes are read on the host), so it stays one segment and one
break a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphcp.config import PipelineStage
from graphcp.model.config import ModelConfig
from graphcp.model.cp_attention import attend as cp_attend
from graphcp.model.cp_attention import begin_forward, store_kv
from graphcp.model.forward_context import ForwardContext
from graphcp.model.graph_break import graph_break
from graphcp.model.heads import HeadShard, head_shard, local_config
from graphcp.model.layers import ParallelMLP, RMSNorm, Rotary
from graphcp.model.moe.block import SparseMoeBlock
from graphcp.model.moe.ep import STAT_LAYERS, STAT_LAYOUT, STAT_RECEIVED, STAT_SENT
from graphcp.model.moe.experts import grouped_mm_capturable, grouped_mm_sync_free
from graphcp.nvtx_ranges import nvtx_range
from graphcp.options import MoeLayout

_ATTENTION_RANGES: dict[int, str] = {}  # the breaks' range names, formatted once a layer


def _attention_range(layer: int) -> str:
    return _ATTENTION_RANGES.setdefault(layer, f"attention[{layer}]")


def attend(ctx: ForwardContext, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
    """Attend this rank's query rows over the cache as its mode does (the backend over
    the local cache, after fetching a cached prefix a layer-split cache lacks; a sharded
    cache's ring); writes ``out`` in place."""
    with nvtx_range(_ATTENTION_RANGES.get(layer) or _attention_range(layer), category="break"):
        cp_attend(ctx, layer, q, out)


run_attention = graph_break("attention")(attend)


@graph_break("attention+moe")
def run_attention_moe(ctx: ForwardContext, layer: int, block: "ExpertParallelTail", q: torch.Tensor,
                      attn_out: torch.Tensor, resid: torch.Tensor, out: torch.Tensor) -> None:
    """Attention, then the rest of an expert-parallel layer (``ExpertParallelTail.after_attention``):
    writes the layer's output rows into ``out``."""
    attend(ctx, layer, q, attn_out)
    block.after_attention(ctx, attn_out, resid, out)


class Attention(nn.Module):
    """One layer's attention over this rank's heads (``shard``; all of them at attention TP 1)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, shard: HeadShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.shard = shard = shard or head_shard(cfg)
        self.cfg = cfg = local_config(cfg, shard)  # this rank's head counts
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext):
        q, out = self.prepare(x, positions, rotary, ctx)
        run_attention(ctx, self.layer, q, out)
        return self.project(out.view(x.shape[0], self.cfg.q_size), ctx)

    def project(self, attn: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """o_proj: row-parallel under attention TP (the partial sums all-reduced, the bias
        added once after)."""
        if not self.shard.split:
            return self.o_proj(attn)
        y = ctx.comm.reduce_attention(F.linear(attn, self.o_proj.weight))
        return y if self.o_proj.bias is None else y + self.o_proj.bias

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, ctx: ForwardContext):
        """Everything before attention: the query rows and the tensor attention writes."""
        cfg, n = self.cfg, x.shape[0]
        q, k, v = self.qkv(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        store_kv(ctx, self.layer, k, v)
        static = ctx.inputs
        if static.attn_q is not None:
            q = static.attn_q.copy_(q)
            out = static.attn_out
        else:  # zeros: attention writes the segments' rows only, and a padding row's
            out = torch.zeros_like(q)  # output feeds its K/V (scratch page) in the next layer
        return q, out


class ExpertParallelTail(nn.Module):
    """What a decoder layer whose experts are split over the ranks
    (``RuntimeConfig.moe="ep"``) runs after attention, inside the attention break: the
    exchange's split sizes are read on the host, so the layer stays one captured
    segment and one break. A layer sets ``layer``, ``self_attn.o_proj``,
    ``post_attention_layernorm`` and ``mlp`` (a SparseMoeBlock)."""

    def break_rows(self, h: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual rows the break reads and the rows it writes the layer's output
        to (graph mode: static rows)."""
        static = ctx.inputs
        if static.moe_resid is not None:
            return static.moe_resid.copy_(h), static.moe_out
        return h, torch.empty_like(h)

    def after_attention(self, ctx: ForwardContext, attn_out: torch.Tensor, resid: torch.Tensor,
                        out: torch.Tensor) -> None:
        """o_proj, residual, norm and the MoE: expert-parallel over this rank's live rows
        (padding rows pass through with no MLP output), or the ``tp`` layout over every
        row as a captured graph would run it (its experts held out of CUDA graphs,
        :meth:`DecoderModel.hold_experts_out_of_graphs`); the layer's rows into ``out``."""
        n = resid.shape[0]
        h = resid + self.self_attn.project(attn_out.view(n, -1), ctx)
        live = n if ctx.inputs.live_rows is None else ctx.inputs.live_rows
        with nvtx_range(f"moe[{self.layer}]", category="break"):
            x = self.post_attention_layernorm(h)
            if self.mlp.layout == "ep":
                moe = self.mlp.forward_ep(x, live, ctx.comm, ctx.stats)
            else:
                moe = self.mlp(x, ctx.comm)
        torch.add(h, moe, out=out)


class DecoderLayer(ExpertParallelTail):
    """``tp_size``/``rank``: the FFN's TP degree and this rank's place in it (the stage's
    T ranks); ``shard``: this rank's attention heads."""

    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int = 0,
                 moe: MoeLayout = "ep", shard: HeadShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.moe is not None and cfg.moe.is_sparse(layer):
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, moe, rank, tp_size, dtype)
        else:
            self.mlp = ParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp_size, cfg.mlp_bias, dtype)
        #: the MoE runs in the attention break: experts split over the ranks (the all-to-all
        #: exchange), or tp experts held out of CUDA graphs (DecoderModel.hold_experts_out_of_graphs)
        self.exchanges = isinstance(self.mlp, SparseMoeBlock) and moe == "ep"

    def forward(self, h, positions, rotary, ctx):
        if self.exchanges:
            q, attn_out = self.self_attn.prepare(self.input_layernorm(h), positions, rotary, ctx)
            resid, out = self.break_rows(h, ctx)
            run_attention_moe(ctx, self.layer, self, q, attn_out, resid, out)
            return out
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx.comm)


class DecoderModel(nn.Module):
    """The body (embedding -> layers -> final norm) and the LM head; under pipeline
    parallelism one stage of it: its layers only, the embedding on the first stage,
    the final norm and LM head on the last (with tied embeddings the last stage
    holds the embedding matrix as its LM head)."""

    def __init__(self, cfg: ModelConfig, tp_size: int, dtype: torch.dtype, max_positions: int | None = None,
                 rank: int = 0, moe: MoeLayout = "ep", stage: PipelineStage | None = None,
                 shard: HeadShard | None = None):
        super().__init__()
        self.cfg, self.tp_size, self.dtype = cfg, tp_size, dtype
        #: this rank's attention heads, and the config with its head counts (caches and backends size by it)
        self.shard = shard or head_shard(cfg)
        self.attn_cfg = local_config(cfg, self.shard)
        self.moe_layout = moe
        self.stage = stage = stage or PipelineStage(0, 1, range(cfg.num_layers))
        embed = stage.first or (stage.last and cfg.tie_word_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if embed else None
        self.layers = nn.ModuleList(self.make_layer(cfg, i, tp_size, dtype, rank, moe) for i in stage.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.last else None
        untied = stage.last and not cfg.tie_word_embeddings
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype) if untied else None
        self.rotary = self.make_rotary(cfg, max_positions)
        for p in self.parameters():
            p.requires_grad_(False)

    def make_layer(self, cfg: ModelConfig, layer: int, tp_size: int, dtype: torch.dtype, rank: int,
                   moe: MoeLayout) -> nn.Module:
        """One decoder layer (a model family with other layers overrides it)."""
        return DecoderLayer(cfg, layer, tp_size, dtype, rank, moe, self.shard)

    @staticmethod
    def make_rotary(cfg: ModelConfig, max_positions: int | None = None) -> nn.Module:
        """The RoPE tables (computed, never loaded: the loader rebuilds them on the device)."""
        return Rotary(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)

    def body(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
             hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Local rows in (token ids on the first stage, the previous stage's hidden
        rows ``hidden_in`` on the others), hidden states of the same rows out: after
        the final norm on the last stage, the last layer's output on the others."""
        begin_forward(ctx)
        h = self.embed_tokens(input_ids) if hidden_in is None else hidden_in
        for i, layer in zip(self.stage.layers, self.layers):
            with nvtx_range(f"layer[{i}]", category="eager"):
                h = layer(h, positions, self.rotary, ctx)
            if ctx.aux is not None:
                ctx.aux.write(i, h)
        return self.norm(h) if self.norm is not None else h

    def static_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Static break rows besides attn_q / attn_out (graph mode): none."""
        return {}

    @property
    def handoff_size(self) -> int:
        """Values a row carries from one pipeline stage to the next (the residual)."""
        return self.cfg.hidden_size

    @property
    def output_size(self) -> int:
        """Values a row of :meth:`body`'s output holds: the final-normed hidden state on the
        last stage, the residual handed on elsewhere."""
        return self.cfg.hidden_size if self.stage.last else self.handoff_size

    @property
    def exchanges(self) -> bool:
        """Whether some layer runs the expert-parallel exchange (a host-sized break)."""
        return any(layer.exchanges for layer in self.layers)

    def static_stats(self, rows: int) -> dict:
        """The per-forward figures fixed by the local row count (ForwardInfo.stats): the
        MoE layout and the bytes of the collectives of shape-static MoE layers; the
        expert-parallel exchange adds its routing-dependent bytes as it runs."""
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        if not blocks:
            return {}
        row_bytes = self.cfg.hidden_size * self.dtype.itemsize
        A = self.shard.size
        b = sum(m.static_bytes(rows, row_bytes, self.tp_size // A, A) for m in blocks)
        return {STAT_LAYOUT: self.moe_layout, STAT_LAYERS: len(blocks), STAT_SENT: b, STAT_RECEIVED: b}

    def capture_problem(self, device: torch.device, full: bool) -> str | None:
        """Why this model's body cannot be captured as asked on ``device``, or None (what
        no device runs, a full graph with ``moe='ep'``, is refused with the config:
        graphcp/combinations.py)."""
        tp_moe = any(isinstance(layer.mlp, SparseMoeBlock) and not layer.exchanges for layer in self.layers)
        if tp_moe and not grouped_mm_sync_free(device, self.dtype):
            return (f"RuntimeConfig.moe='tp' keeps the experts inside the captured graphs, which needs "
                    f"torch._grouped_mm's sync-free kernel (bfloat16 on sm90/sm100/sm103); {self.dtype} on {device} "
                    "copies the group sizes to the host: use moe='ep', dtype='bfloat16' or graph='off'")
        if tp_moe and full and not grouped_mm_capturable(device, self.dtype):
            return ("RuntimeConfig.graph='full' would capture the experts of moe='tp', and a captured "
                    "torch._grouped_mm has not yet replayed correctly on a GPU here (pytorch issue 169970: an "
                    "illegal memory access at replay on H100/H200, torch >= 2.9): use graph='breakable' (the "
                    "experts then run in the attention break, eagerly), moe='ep' or graph='off'")
        return None

    def hold_experts_out_of_graphs(self, device: torch.device) -> bool:
        """Breakable graphs on ``device`` where a captured grouped matmul is not trusted yet
        (:func:`grouped_mm_capturable`): the ``tp`` layout's MoE layers run their experts in
        the attention break, eagerly, as ``ep`` layers run their exchange (one break per
        layer still). Returns whether any layer moved."""
        moved = False
        if not grouped_mm_capturable(device, self.dtype):
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoeBlock) and not layer.exchanges:
                    layer.exchanges = moved = True
        return moved

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, w.t()).float()
