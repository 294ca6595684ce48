"""An MLA layer with no indexer in a decode graph (Kimi Linear's full layers): every shape
its bucket's, reading no host value. Each row attends over every cached token of its
request: the selection is each row's positions ``0 .. kv_len - 1`` (the bucket's ``[B,
W pages]`` table wide, -1 past its length), and the attention is the DSA family's decode
form over it (graphcp.model.dsa.sparse_decode: MLA's weight-absorbed form in float32)."""

from __future__ import annotations

import torch

from graphcp.attention.base import AttentionMetadata
from graphcp.model.dsa.cache import MlaStorage
from graphcp.model.dsa.sparse import SparseMlaSpec
from graphcp.model.dsa.sparse_decode import PagedSparseMlaDecode


class DenseLatentDecode(PagedSparseMlaDecode):
    """A decode bucket's dense latent attention (module doc), bound to its static ``meta``."""

    name = "paged-latent-decode"

    def __init__(self, spec: SparseMlaSpec, meta: AttentionMetadata) -> None:
        super(PagedSparseMlaDecode, self).__init__(spec)  # no selection buffer: no indexer
        self.meta = meta

    def selection_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        raise NotImplementedError("a dense latent attention selects no tokens")

    def forward(self, layer, q, index_q, index_w, kv_b_weight, cache: MlaStorage, out) -> None:
        table, lens = self.meta.page_table, self.meta.kv_lens.long()
        width = table.shape[1] * cache.page_size
        every = torch.arange(width, device=lens.device).expand(table.shape[0], width)
        self.attend_selected(layer, q, kv_b_weight, cache, every.masked_fill(every >= lens[:, None], -1), out)
