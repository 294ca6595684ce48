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

An import (``engine.import_kv``) is the inverse (:meth:`DsV4Source.write_import`): the
window rows, the entries and the source rows the next poolings read are written where
a prefill of the request would have written them. The overlap gates travel with the
bias added in float32 (transformers' state); subtracting it back rounds once, so the
pooled gate of the first window closing after an import is within one float32 rounding
of the prefilled engine's (every other row is written bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from graphcp.kv.handle import KVHandle
from graphcp.kv.paged import PagedKVCache
from graphcp.kv.spans import KVSpan
from graphcp.model.dsv4.cache import CSA
from graphcp.model.dsv4.export import layer_tensor_names


@dataclass(frozen=True)
class Biases:
    """A compressed layer's float32 ``position_bias [m, width]`` (its compressor's and,
    CSA, its indexer's)."""

    compressor: torch.Tensor
    indexer: torch.Tensor | None = None


class DsV4Source:
    def __init__(self, cache: PagedKVCache, biases: dict[int, Biases], sliding_window: int) -> None:
        self.cache, self.biases = cache, biases
        self.storage = cache.storage  # a DsV4Storage (graphcp.model.dsv4.cache)
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
        spec = self.storage.cfg
        return [state[n] for n in layer_tensor_names(spec.layer_kinds[span.layer], T, spec.compress_csa)]

    def layer_state(self, handle: KVHandle, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors by name (graphcp.model.dsv4.export's module docstring)."""
        self.cache.check_handle(handle)
        spec, T = self.storage.cfg, handle.num_tokens
        window_from = T - min(T, self.window_rows)
        m = spec.compress_rate(layer)
        if not m:
            return {"window": self.storage.read_tokens(handle, layer, window_from)["window"]}
        n = T // m
        kind = spec.layer_kinds[layer]
        overlap = kind == CSA and n >= 1
        first = (n - 1) * m if overlap else n * m  # the first source row still read
        rows = self.storage.read_tokens(handle, layer, window_from, first)
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

    # ---- an import (PrefillEngine.import_kv): transformers' state back into the pools -----
    def imports_whole(self, layer: int) -> bool:
        return True  # a layer's state is not one row a token

    def write_import(self, handle: KVHandle, layer: int, values: Sequence[torch.Tensor]) -> None:
        """Layer ``layer``'s tensors (:meth:`read_span`'s, of the whole request) into the
        pools, as if this engine had prefilled the request: the window rows of the last
        ``sliding_window - 1`` positions, the entries, and the source rows the next
        poolings read (the remainder's both series; CSA: the last closed window's first
        series, its gate less the ``position_bias`` the export added). What no later read
        needs is not written: older window rows, older source rows and the second series
        of the last closed window (a CSA entry pools the previous window's first series
        and its own window's second)."""
        spec, T = self.storage.cfg, handle.num_tokens
        kind = spec.layer_kinds[layer]
        state = dict(zip(layer_tensor_names(kind, T, spec.compress_csa), values, strict=True))
        window = state["window"]
        rows = {"window": window}
        m = spec.compress_rate(layer)
        first = T
        if m:
            n = T // m
            overlap = kind == CSA and n >= 1
            first = (n - 1) * m if overlap else n * m
            series = 2 if kind == CSA else 1
            b = self.biases[layer]
            parts = [("", spec.head_dim, b.compressor)]
            if kind == CSA:
                parts.append(("index_", spec.index_head_dim, b.indexer))
            blocks = []
            for prefix, width, bias in parts:
                kv = window.new_zeros(T - first, series * width)
                gate = torch.zeros_like(kv)
                kv[n * m - first:] = state[prefix + "buffer_kv"]
                gate[n * m - first:] = state[prefix + "buffer_gate"]
                if overlap:
                    kv[:m, :width] = state[prefix + "overlap_kv"]
                    gate[:m, :width] = (state[prefix + "overlap_gate"].float() - bias[:, :width].float()).to(gate.dtype)
                blocks += [kv, gate]
            rows["sources"] = torch.cat(blocks, dim=1)
            rows["entries"] = state["compressed_kv"]
            if kind == CSA:
                rows["index_entries"] = state["index_compressed_kv"]
        self.storage.write_tokens(handle, layer, rows, T - window.shape[0], first)


def export_source(cache: PagedKVCache, layers: Iterable[tuple[int, nn.Module]], sliding_window: int) -> DsV4Source:
    """The source of an engine's V4 cache; ``layers``: ``(layer index, decoder layer)`` of
    the model (their ``self_attn.compressor`` / ``.indexer`` hold the biases)."""
    biases = {}
    for i, layer in layers:
        attn = layer.self_attn
        if attn.compressor is not None:
            biases[i] = Biases(attn.compressor.position_bias,
                               None if attn.indexer is None else attn.indexer.position_bias)
    return DsV4Source(cache, biases, sliding_window)
