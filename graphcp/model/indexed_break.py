"""What the attention layers of the indexed families (DSA, DeepSeek V4) share around
their attention break: its static rows in graph mode (the query, the indexer's query and
head weights, and the output the break writes), so captured graphs pin no intermediate
memory for them. (Their cache rows are stored through the forward's KV exchange:
graphcp.model.cp_attention.store_rows.)"""

from __future__ import annotations

import torch

from graphcp.model.forward_context import ForwardContext

#: graph-mode static rows of the attention break (StaticBuffers' extra rows)
STATIC_Q, STATIC_OUT, STATIC_INDEX_Q, STATIC_INDEX_W = "attn_q", "attn_out", "index_q", "index_w"


def break_rows(ctx: ForwardContext, q: torch.Tensor, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
               out_row: tuple[int, ...]):
    """The tensors the break reads and writes: the static rows in graph mode, else ``q``,
    the indexer's and a new ``[rows, *out_row]`` output."""
    static = ctx.inputs.extra
    if static is None:
        return q, index_q, index_w, q.new_empty(q.shape[0], *out_row)
    q = static[STATIC_Q].copy_(q)
    if index_q is not None:
        index_q, index_w = static[STATIC_INDEX_Q].copy_(index_q), static[STATIC_INDEX_W].copy_(index_w)
    return q, index_q, index_w, static[STATIC_OUT]


def static_rows(heads: int, q_dim: int, out_dim: int, index_heads: int | None, index_dim: int,
                dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The break's static rows (per row shape and dtype); ``index_heads`` None: no indexer."""
    rows = {STATIC_Q: ((heads, q_dim), dtype), STATIC_OUT: ((heads, out_dim), dtype)}
    if index_heads is not None:
        rows[STATIC_INDEX_Q] = ((index_heads, index_dim), dtype)
        rows[STATIC_INDEX_W] = ((index_heads,), torch.float32)
    return rows
