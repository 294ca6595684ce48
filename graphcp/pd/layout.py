"""What every export format shares: per layer, named tensors with the tokens along one
dimension, and their flat layout (the transports' byte offsets).

A format's metadata (``graphcp-kv/1``'s :class:`graphcp.pd.export.KVMeta`, or the one a
family registers with its format, graphcp.pd.formats) says, for each layer, which
tensors it has (:meth:`TensorLayout.layer_tensors`, in order: what a cache's
``read_span`` returns for that layer), their shapes (:meth:`TensorLayout.tensor_shape`,
the tokens along :attr:`TensorLayout.token_dim`) and dtypes
(:meth:`TensorLayout.tensor_dtype`: the model's unless a format says otherwise). From
that alone this mixin derives what assembly (``graphcp.pd.export.assemble``), the files
and the Mooncake transport need: each tensor's byte offset in the flat region (layer
0's tensors in order, then layer 1's, ...), the byte runs a span of positions occupies
there, and the flat region's tensors.
"""

from __future__ import annotations

import math

import torch

from graphcp.pd.errors import KVImportError


class TensorLayout:
    """Mixed into a format's metadata (a frozen dataclass with ``num_layers``,
    ``num_tokens`` and ``torch_dtype``): the type of every format's metadata (what
    ``ModelFamily.export_meta`` returns)."""

    #: the layers and tokens of the request (the metadata's fields; ``torch_dtype`` is its dtype)
    num_layers: int
    num_tokens: int
    #: the dimension along which a tensor holds the request's tokens
    token_dim: int = 0

    def make_export(self, layers: list[dict[str, torch.Tensor]], **extra):
        """The format's export of ``layers`` (per layer, its tensors by name)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, str]:
        """The metadata as strings (what a file's header and a transport's hello carry)."""
        raise NotImplementedError

    def layer_tensors(self, layer: int) -> tuple[str, ...]:
        """The names of ``layer``'s tensors, in order."""
        raise NotImplementedError

    def tensor_shape(self, layer: int, name: str, num_tokens: int | None = None) -> tuple[int, ...]:
        """Tensor ``name`` of ``layer`` over ``num_tokens`` tokens (default: the request's)."""
        raise NotImplementedError

    def tensor_dtype(self, layer: int, name: str) -> torch.dtype:
        """Tensor ``name``'s dtype: the model's, unless a format keeps a tensor in another
        (float32 gates beside model-dtype rows)."""
        return self.torch_dtype

    def take_heads(self, layer: int, name: str, whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        """Attention-TP rank ``rank`` of ``size``'s share of tensor ``name`` of ``layer`` (the
        whole model's: the inverse of ``merge_heads``), what an import places on that rank;
        a format that splits no heads says so (KVImportError)."""
        raise KVImportError(f"import_kv: format {getattr(self, 'format', '?')!r} has no attention-TP share of its "
                            f"tensors; import it into an engine with attention TP 1")

    def tensors(self) -> list[tuple[int, str]]:
        """Every ``(layer, name)`` in the flat layout's order."""
        return [(i, n) for i in range(self.num_layers) for n in self.layer_tensors(i)]

    def nbytes_of(self, layer: int, name: str, num_tokens: int | None = None) -> int:
        return math.prod(self.tensor_shape(layer, name, num_tokens)) * self.tensor_dtype(layer, name).itemsize

    @property
    def nbytes(self) -> int:
        """The whole request, every tensor of every layer."""
        return sum(self.nbytes_of(i, n) for i, n in self.tensors())

    def tensor_offset(self, layer: int, name: str) -> int:
        """Byte offset of tensor ``(layer, name)`` in the flat layout."""
        at = 0
        for i, n in self.tensors():
            if (i, n) == (layer, name):
                return at
            at += self.nbytes_of(i, n)
        raise KeyError(f"no tensor {name!r} in layer {layer}")

    def span_runs(self, layer: int, name: str, start: int, num_tokens: int) -> list[tuple[int, int, int]]:
        """``(offset in the span's tensor, offset in the flat layout, bytes)`` runs that
        put positions ``[start, start + num_tokens)`` of tensor ``(layer, name)`` (a
        contiguous ``tensor_shape(layer, name, num_tokens)`` tensor) in place: one run a
        slice before the token dimension (a head of K/V), one in all when there is none."""
        shape = self.tensor_shape(layer, name)
        outer, inner = math.prod(shape[:self.token_dim]), math.prod(shape[self.token_dim + 1:])
        item, total = self.tensor_dtype(layer, name).itemsize, shape[self.token_dim]
        base, run = self.tensor_offset(layer, name), num_tokens * inner * item
        return [(o * run, base + (o * total + start) * inner * item, run) for o in range(outer)]

    def unflatten(self, flat: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per layer, views of each tensor in ``flat`` (the flat layout's bytes, uint8; a
        tensor whose offset is not a multiple of its item size, after tensors of a smaller
        dtype, is a copy)."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_layers)]
        at = 0
        for i, n in self.tensors():
            dtype, nbytes = self.tensor_dtype(i, n), self.nbytes_of(i, n)
            raw = flat[at:at + nbytes]
            if (flat.storage_offset() + at) % dtype.itemsize:
                raw = raw.clone()
            out[i][n] = raw.view(dtype).view(self.tensor_shape(i, n))
            at += nbytes
        return out
