"""graphcp: a context-parallel prefill (and decode) runtime with per-bucket breakable graphs."""

from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.cp import InterleaveLayout, ZigzagLayout, make_layout
from graphcp.dist import CPGroup, init_from_env, launch
from graphcp.errors import BatchError, ConfigError, GraphcpError, InputError
from graphcp.kv.paged import KVCacheFull, KVHandle, KVHandleError
from graphcp.model.config import ModelConfig
from graphcp.runtime.batch import ConsistencyError, ForwardInfo, PrefillOutput, Request
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.decode.batch import DecodeOutput
from graphcp.runtime.decode.generate import Conversation, GenerateOutput
from graphcp.runtime.engine import PrefillEngine

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
    "ModelConfig",
    "ParallelConfig",
    "PrefillEngine",
    "PrefillOutput",
    "Request",
    "RuntimeConfig",
    "ZigzagLayout",
    "init_from_env",
    "launch",
    "make_layout",
]
