"""Prefill/decode disaggregation: a request's KV handed to a decode side.

- :mod:`graphcp.pd.export`: the transport-neutral layout (:class:`KVExport`, :class:`KVMeta`:
  ``graphcp-kv/1``) and its assembly from the spans each rank holds (``PrefillEngine.export_kv``);
- :mod:`graphcp.pd.layout`: what every format's metadata derives its flat layout from;
- :mod:`graphcp.pd.formats`: the formats by name (:func:`register_format`): graphcp-kv/1, and
  each family whose cache is not per-head K/V registers its own from its folder;
- :mod:`graphcp.pd.files`: one safetensors file a request; :mod:`graphcp.pd.load`: a file
  with its transformers cache (:func:`load_kv`); :mod:`graphcp.pd.hf`: transformers' side;
- :mod:`graphcp.pd.mooncake`: the Mooncake transfer-engine transport (sender per
  prefill rank, receiver on the decode side, their control channel).

Everything here reads the formats registered so far: graphcp-kv/1, and every built-in
family's once ``graphcp.model`` is imported (an engine imports it). ``from graphcp import
load_kv`` (and ``read_kv``, ``KVReceiver``) imports the built-in families first: the name
for a program that only reads KV. See docs/pd.md.
"""

from graphcp.pd.export import KVExport, KVFormatError, KVMeta
from graphcp.pd.formats import register_format
from graphcp.pd.load import LoadedKV, load_kv

__all__ = ["KVExport", "KVFormatError", "KVMeta", "LoadedKV", "load_kv", "register_format"]
