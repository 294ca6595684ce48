"""``triton`` sparse MLA: the torch reference's indexer and top-k, then a Triton kernel
that gathers each row's selected tokens from the paged latent cache
(:mod:`graphcp.attention.kernels.sparse_latent`, the weight-absorbed form).

Per layer: every block of this rank's rows gets its selection from
:meth:`SelectingSparseMla.selected_blocks` (the one home of scoring and top-k); rows
that see at most ``index_topk`` tokens are not scored and get the selection "every
token up to my position" (:func:`causal_positions`), so one kernel form serves dense
and sparse rows. The ``[rows, index_topk]`` positions, each row's page-table row and
the page table go to one launch over all rows (padding rows: no selection, zeros).
Around it, in torch: ``q_lat = q_nope @ W_UK`` per head before, ``out = out_lat @
W_UV^T`` per head after (``W_UK``/``W_UV``: the k_nope and v rows of ``kv_b_proj``).
No per-head K/V is ever decompressed.

It reads host metadata (the row groups), like the reference: in graph mode it runs in
the attention break, eagerly, so the launch needs no registered op. Tile settings per
latent width and dtype: :mod:`graphcp.attention.kernels.sparse_latent_configs`.

Products: on a GPU, bfloat16/float16 operands go to ``tl.dot`` as they are (tensor
cores, float32 accumulation; the probabilities are rounded to the operand dtype
before PV, as FlashMLA does); float32 operands use IEEE products (no TF32). Under the
Triton interpreter (CPU) ``tl.dot`` on bfloat16 is wrong, so bfloat16 operands are
upcast to float32 there (:func:`graphcp.attention.backends.triton.interpreting`).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from graphcp.attention.backends.triton import interpreting
from graphcp.attention.base import AttentionMetadata, BatchRequests
from graphcp.attention.kernels.sparse_latent_configs import SparseTileConfig, sparse_tile_config
from graphcp.attention.staging import to_device
from graphcp.errors import ConfigError, InputError
from graphcp.model.dsa.cache import MlaStorage
from graphcp.model.dsa.sparse import SelectingSparseMla, SparseMlaSpec
from graphcp.model.dsa.topk import Selector, causal_positions, select_topk


def _import_kernel() -> ModuleType:
    try:
        from graphcp.attention.kernels import sparse_latent as sparse_mla_kernel
    except ImportError as e:  # triton missing or broken
        raise ImportError(f"the 'triton' sparse MLA attention needs the triton package ({e}); "
                          "install it with `pip install triton`") from e
    return sparse_mla_kernel


class TritonSparseMla(SelectingSparseMla):
    name = "triton"

    def __init__(self, spec: SparseMlaSpec, selector: Selector = select_topk,
                 tile: SparseTileConfig | None = None) -> None:
        """``tile``: explicit kernel settings (None: :func:`sparse_tile_config` per dtype)."""
        super().__init__(spec, selector)
        if tile is not None and (tile.block_h < 16 or tile.block_h & (tile.block_h - 1)
                                 or tile.block_n < 16 or tile.block_n & (tile.block_n - 1)):
            raise ConfigError(f"block_h and block_n must be powers of two >= 16 (tl.dot tiles), got {tile}")
        self._kernel = _import_kernel()
        self._tile = tile
        self._tables: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (rows, page table, row table)

    def config(self, dtype: torch.dtype) -> SparseTileConfig:
        """The tile settings a launch on ``dtype`` operands uses."""
        return self._tile or sparse_tile_config(self.spec.kv_lora_rank, dtype)

    def prepare(self, meta: AttentionMetadata, requests: BatchRequests | None = None) -> None:
        super().prepare(meta, requests)
        self._tables = None

    def _page_tables(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's page table (one row per row group) and each query row's row of it
        (padding rows: 0; they select nothing)."""
        if self._tables is None or self._tables[0] != rows:
            groups = self.groups
            width = max([g.pages.size for g in groups] + [1])
            table = np.zeros((max(len(groups), 1), width), dtype=np.int32)
            row_table = np.zeros(rows, dtype=np.int32)
            for i, g in enumerate(groups):
                table[i, : g.pages.size] = g.pages
                row_table[g.q0:g.q1] = i
            self._tables = (rows, to_device(table, device), to_device(row_table, device))
        return self._tables[1], self._tables[2]

    def selection(self, layer: int, rows: int, index_q: torch.Tensor | None, index_w: torch.Tensor | None,
                  cache: MlaStorage, device: torch.device) -> torch.Tensor:
        """int32 ``[rows, index_topk]``: every row's selected positions (ascending, -1
        padded; dense rows: 0 .. their position; padding rows: all -1)."""
        k = self.spec.index_topk
        selected = torch.full((rows, k), -1, dtype=torch.int32, device=device)
        for blk in self.selected_blocks(layer, index_q, index_w, cache, device):
            sel = blk.selection
            if sel is None:
                sel = causal_positions(blk.positions_on_device, k)
            selected[blk.rows, : sel.shape[1]] = sel.to(torch.int32)
        return selected

    def forward(self, layer, q, index_q, index_w, kv_b_weight, cache, out) -> None:
        sp = self.spec
        self._check(layer, q, cache, out)
        rows, dev = q.shape[0], q.device
        selected = self.selection(layer, rows, index_q, index_w, cache, dev)
        counts = (selected >= 0).sum(-1, dtype=torch.int32)  # the -1 padding trails
        page_table, row_table = self._page_tables(rows, dev)
        w = kv_b_weight.view(sp.num_heads, sp.qk_nope_head_dim + sp.v_head_dim, sp.kv_lora_rank)
        w_uk, w_uv = w.split([sp.qk_nope_head_dim, sp.v_head_dim], dim=1)  # [H, nope, c], [H, v, c]
        q_nope, q_rope = q.split([sp.qk_nope_head_dim, sp.qk_rope_head_dim], dim=-1)
        # [rows, H, c] row-major, as the kernel reads it: bmm's [H, rows, c] transposed would make
        # the head stride rows x c (past 2**31 elements at DeepSeek V3.2's 128 x 512 and ~33K rows)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
        out_lat = torch.empty(rows, sp.num_heads, sp.kv_lora_rank, dtype=q.dtype, device=dev)
        cfg = self.config(q.dtype)
        self._kernel.launch(q_lat, q_rope, cache.latent(layer), out_lat, selected, counts, row_table, page_table,
                            page_size=cache.page_size, scale=sp.softmax_scale, block_h=cfg.block_h,
                            block_n=cfg.block_n, upcast_dot=interpreting() and q.dtype != torch.float32,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        out.copy_(torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))

    def _check(self, layer: int, q: torch.Tensor, cache: MlaStorage, out: torch.Tensor) -> None:
        sp = self.spec
        want = (sp.num_heads, sp.qk_head_dim)
        if q.dim() != 3 or tuple(q.shape[1:]) != want:
            raise InputError(f"q must be [rows, {want[0]}, {want[1]}], got {tuple(q.shape)}")
        lat = cache.latent(layer)
        if lat.dtype != q.dtype or lat.shape[-1] != sp.kv_lora_rank + sp.qk_rope_head_dim:
            raise InputError(f"the latent cache must be {q.dtype} with {sp.kv_lora_rank + sp.qk_rope_head_dim} values "
                             f"a token (q's dtype; kv_lora_rank + qk_rope_head_dim), got {lat.dtype} "
                             f"with {lat.shape[-1]}")
        if tuple(out.shape) != (q.shape[0], sp.num_heads, sp.v_head_dim):
            raise InputError(f"out must be [{q.shape[0]}, {sp.num_heads}, {sp.v_head_dim}], got {tuple(out.shape)}")
