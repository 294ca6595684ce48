"""Prefill/decode disaggregation: a request's KV handed to a decode side.

- :mod:`graphcp.pd.export`: the transport-neutral layout (:class:`KVExport`, :class:`KVMeta`)
  and its assembly from the spans each rank holds (``PrefillEngine.export_kv``);
- :mod:`graphcp.model.dsa.export`, :mod:`graphcp.model.dsv4.export`: the DSA models' and
  DeepSeek V4's formats (their caches are not per-head K/V);
- :mod:`graphcp.pd.files`: one safetensors file a request;
- :mod:`graphcp.pd.hf`: a transformers ``DynamicCache`` from an export;
- :mod:`graphcp.pd.mooncake`: the Mooncake transfer-engine transport (sender per
  prefill rank, receiver on the decode side, their control channel).

See docs/pd.md.
"""

from graphcp.pd.export import KVExport, KVFormatError, KVMeta
from graphcp.pd.load import LoadedKV, load_kv

__all__ = ["KVExport", "KVFormatError", "KVMeta", "LoadedKV", "load_kv"]
