"""What a PrefillEngine runs a DeepSeek V4 model with: the attention break's backend (the
torch reference) over its paged cache (window, source rows, compressed entries:
graphcp/model/dsv4/cache.py, replicated on every CP rank or split by layer, from
graphcp.kv.factory), and the page sizes it refuses. The options V4 does not combine with
are refused with the config (graphcp/combinations.py)."""

from __future__ import annotations

from graphcp.model.config import ModelConfig
from graphcp.model.dsv4.cache import entries_per_page
from graphcp.model.dsv4.rope import COMPRESS, V4Rotary
from graphcp.model.dsv4.sparse import DsV4AttentionSpec, TorchDsV4Attention
from graphcp.model.dsv4.sparse_decode import PagedDsV4Decode


def check_page_size(cfg: ModelConfig, page_size: int, where: str = "RuntimeConfig.page_size") -> None:
    """ConfigError naming ``where`` when a compress rate and the page size do not divide."""
    for rate in (cfg.dsv4.compress_csa, cfg.dsv4.compress_hca):
        entries_per_page(page_size, rate, where)


def make_attention(cfg: ModelConfig, rotary: V4Rotary, layers: range) -> TorchDsV4Attention:
    """The attention break's backend of ``layers`` (a pipeline stage's): the torch reference."""
    d = cfg.dsv4
    spec = DsV4AttentionSpec(d.cache, cfg.num_heads, d.sliding_window, d.index_n_heads, d.index_topk,
                             cfg.rms_norm_eps)
    attention = TorchDsV4Attention(spec, *rotary.table(COMPRESS), layers)
    attention.decode_form = PagedDsV4Decode  # what a decode graph captures
    return attention
