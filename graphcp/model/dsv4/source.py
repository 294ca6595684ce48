"""A DeepSeek V4 cache as an export source (graphcp.kv.spans.KVSource): what
``PrefillEngine.export_kv`` and the Mooncake sender read a V4 request from.

The cache keeps each token's rows and the pooled entries (graphcp.model.dsv4.cache); transformers
keeps a window, the entries, the not-yet-pooled remainder and CSA's overlap state. This
reads the former into the latter (graphcp.model.dsv4.export): the last ``sliding_window -
1`` window rows, the entries, and the source rows of the last ``2 m`` tokens at most,
never the whole request's rows. The overlap gates add the layer's ``position_bias``
(model weights, not cache), so the source holds each compressed layer's biases.

Each layer is one span of the whole request: read on any rank of a replicated cache,
on the layer's owner under LayerSplit (and sent from there, as any other span).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from graphcp.kv.paged import KVHandle
from graphcp.kv.spans import KVSpan
from graphcp.model.dsv4.cache import CSA, DsV4KVCache
from graphcp.model.dsv4.export import layer_tensor_names


@dataclass(frozen=True)
class Biases:
    """A compressed layer's float32 ``position_bias [m, width]`` (its compressor's and,
    CSA, its indexer's)."""

    compressor: torch.Tensor
    indexer: torch.Tensor | None = None


class DsV4Source:
    def __init__(self, cache: DsV4KVCache, biases: dict[int, Biases], sliding_window: int) -> None:
        self.cache, self.biases = cache, biases
        self.window_rows = sliding_window - 1  # the window rows transformers keeps

    def kv_spans(self, handle: KVHandle, cp_size: int) -> list[KVSpan]:
        return self.cache.kv_spans(handle, cp_size)

    def holds(self, span: KVSpan, rank: int) -> bool:
        return self.cache.holds(span, rank)  # every rank, or a LayerSplit layer's owner

    def check_handle(self, handle: KVHandle) -> None:
        self.cache.check_handle(handle)

    def read_span(self, handle: KVHandle, span: KVSpan) -> list[torch.Tensor]:
        """Layer ``span.layer``'s state after the request, in the format's tensor order
        (``span``: the whole request, as ``kv_spans`` cuts it)."""
        T = handle.num_tokens
        if (span.start, span.stop) != (0, T):
            raise ValueError(f"a V4 export reads layer {span.layer} whole (positions 0..{T}), not "
                             f"{span.start}..{span.stop}")
        state = self.layer_state(handle, span.layer)
        spec = self.cache.cfg
        return [state[n] for n in layer_tensor_names(spec.layer_kinds[span.layer], T, spec.compress_csa)]

    def layer_state(self, handle: KVHandle, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors by name (graphcp.model.dsv4.export's module docstring)."""
        spec, T = self.cache.cfg, handle.num_tokens
        window_from = T - min(T, self.window_rows)
        m = spec.compress_rate(layer)
        if not m:
            return {"window": self.cache.read_tokens(handle, layer, window_from)["window"]}
        n = T // m
        kind = spec.layer_kinds[layer]
        overlap = kind == CSA and n >= 1
        first = (n - 1) * m if overlap else n * m  # the first source row still read
        rows = self.cache.read_tokens(handle, layer, window_from, first)
        src = rows["sources"]
        hd, ihd = spec.head_dim, spec.index_head_dim
        out = {"window": rows["window"], "compressed_kv": rows["entries"]}
        series = 2 if kind == CSA else 1
        b = self.biases[layer]
        parts = [("", hd, src[:, : 2 * series * hd], b.compressor)]
        if kind == CSA:
            out["index_compressed_kv"] = rows["index_entries"]
            parts.append(("index_", ihd, src[:, 2 * series * hd:], b.indexer))
        for prefix, width, s, bias in parts:
            kv, gate = s[:, : series * width], s[:, series * width:]
            rest = n * m - first  # the remainder's first row in ``s``
            out[prefix + "buffer_kv"] = kv[rest:].contiguous()
            out[prefix + "buffer_gate"] = gate[rest:].contiguous()
            if overlap:  # the last closed window's first series; its gate plus the bias, float32 (transformers')
                out[prefix + "overlap_kv"] = kv[:m, :width].contiguous()
                out[prefix + "overlap_gate"] = gate[:m, :width].float() + bias[:, :width].float()
        return out


def export_source(cache: DsV4KVCache, layers: Iterable[tuple[int, nn.Module]], sliding_window: int) -> DsV4Source:
    """The source of an engine's V4 cache; ``layers``: ``(layer index, decoder layer)`` of
    the model (their ``self_attn.compressor`` / ``.indexer`` hold the biases)."""
    biases = {}
    for i, layer in layers:
        attn = layer.self_attn
        if attn.compressor is not None:
            biases[i] = Biases(attn.compressor.position_bias,
                               None if attn.indexer is None else attn.indexer.position_bias)
    return DsV4Source(cache, biases, sliding_window)
