"""The export formats graphcp writes, by name: ``graphcp-kv/1`` (K/V per layer, every
model but the DSA, V4 and hybrid ones: graphcp.pd.export), ``graphcp-mla/1`` (latent, rope key
and indexer key per layer, DeepSeek V3.2 / GLM-5: graphcp.pd.mla_export) and
``graphcp-dsv4/1`` (window, compressed entries, remainder and overlap state per layer,
DeepSeek V4: graphcp.pd.dsv4_export) and ``graphcp-hybrid/1`` (a full layer's K/V, a linear
layer's conv and recurrent states, the linear-attention hybrids: graphcp.pd.hybrid_export).
Files and the Mooncake receiver read a header's ``format`` here to pick the metadata class."""

from __future__ import annotations

from graphcp.pd.dsv4_export import DSV4_FORMAT, DsV4Export, DsV4Meta
from graphcp.pd.export import FORMAT, KVExport, KVFormatError, KVMeta
from graphcp.pd.hybrid_export import HYBRID_FORMAT, HybridExport, HybridMeta
from graphcp.pd.mla_export import MLA_FORMAT, MlaExport, MlaMeta

FORMATS = (FORMAT, MLA_FORMAT, DSV4_FORMAT, HYBRID_FORMAT)
Meta = KVMeta | MlaMeta | DsV4Meta | HybridMeta
Export = KVExport | MlaExport | DsV4Export | HybridExport


def meta_from_dict(d: dict, source: str = "KV metadata") -> Meta:
    """The metadata of the format ``d["format"]`` names; KVFormatError naming ``source`` otherwise."""
    if not isinstance(d, dict):
        raise KVFormatError(f"{source}: expected a mapping of metadata, got {type(d).__name__}")
    if d.get("format") == MLA_FORMAT:
        return MlaMeta.from_dict(d, source)
    if d.get("format") == DSV4_FORMAT:
        return DsV4Meta.from_dict(d, source)
    if d.get("format") == HYBRID_FORMAT:
        return HybridMeta.from_dict(d, source)
    if "format" in d and d["format"] != FORMAT:
        raise KVFormatError(f"{source}: format {d['format']!r} is none of {list(FORMATS)}")
    return KVMeta.from_dict(d, source)
