"""graphcp: a context-parallel prefill (and decode) runtime with per-bucket breakable graphs.

The names below are imported on first use (PEP 562): ``import graphcp`` and the
command line's parsing stay free of torch, so ``graphcp --help`` and a mistyped flag
answer at once."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: each public name and the module that defines it
_EXPORTS = {
    "BatchError": "graphcp.errors",
    "BucketSet": "graphcp.runtime.capture.buckets",
    "CPGroup": "graphcp.dist",
    "ConfigError": "graphcp.errors",
    "ConsistencyError": "graphcp.runtime.batch",
    "Conversation": "graphcp.runtime.decode.generate",
    "DecodeOutput": "graphcp.runtime.batch",
    "ForwardInfo": "graphcp.runtime.batch",
    "GenerateOutput": "graphcp.runtime.decode.generate",
    "GraphcpError": "graphcp.errors",
    "InputError": "graphcp.errors",
    "InterleaveLayout": "graphcp.cp",
    "KVCacheFull": "graphcp.kv.handle",
    "KVHandle": "graphcp.kv.handle",
    "KVHandleError": "graphcp.kv.handle",
    "KVReceiver": "graphcp.pd.receiver",
    "LoadedKV": "graphcp.pd.load",
    "ModelConfig": "graphcp.model.config",
    "ParallelConfig": "graphcp.config",
    "PrefillEngine": "graphcp.runtime.engine",
    "PrefillOutput": "graphcp.runtime.batch",
    "Request": "graphcp.runtime.batch",
    "RuntimeConfig": "graphcp.config",
    "ZigzagLayout": "graphcp.cp",
    "init_from_env": "graphcp.dist",
    "launch": "graphcp.dist",
    "load_kv": "graphcp.pd.load",
    "make_layout": "graphcp.cp",
    "read_kv": "graphcp.pd.files",
}

#: the names that read a KV export of any family's format (graphcp.pd.formats): each family
#: registers its own when graphcp.model imports it, so it is imported before they resolve
#: (graphcp.pd itself sits below the model and reads only the formats registered so far)
_READ_FORMATS = frozenset({"KVReceiver", "load_kv", "read_kv"})

__all__ = [
    "BatchError",
    "BucketSet",
    "CPGroup",
    "ConfigError",
    "ConsistencyError",
    "Conversation",
    "DecodeOutput",
    "ForwardInfo",
    "GenerateOutput",
    "GraphcpError",
    "InputError",
    "InterleaveLayout",
    "KVCacheFull",
    "KVHandle",
    "KVHandleError",
    "KVReceiver",
    "LoadedKV",
    "ModelConfig",
    "ParallelConfig",
    "PrefillEngine",
    "PrefillOutput",
    "Request",
    "RuntimeConfig",
    "ZigzagLayout",
    "init_from_env",
    "launch",
    "load_kv",
    "make_layout",
    "read_kv",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphcp' has no attribute {name!r}")
    if name in _READ_FORMATS:
        importlib.import_module("graphcp.model")  # every built-in family's format registered
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from graphcp.config import ParallelConfig, RuntimeConfig
    from graphcp.cp import InterleaveLayout, ZigzagLayout, make_layout
    from graphcp.dist import CPGroup, init_from_env, launch
    from graphcp.errors import BatchError, ConfigError, GraphcpError, InputError
    from graphcp.kv.handle import KVCacheFull, KVHandle, KVHandleError
    from graphcp.model.config import ModelConfig
    from graphcp.pd.files import read_kv
    from graphcp.pd.load import LoadedKV, load_kv
    from graphcp.pd.receiver import KVReceiver
    from graphcp.runtime.batch import ConsistencyError, DecodeOutput, ForwardInfo, PrefillOutput, Request
    from graphcp.runtime.capture.buckets import BucketSet
    from graphcp.runtime.decode.generate import Conversation, GenerateOutput
    from graphcp.runtime.engine import PrefillEngine
