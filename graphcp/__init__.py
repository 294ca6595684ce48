"""graphcp: a context-parallel prefill runtime with per-bucket breakable graphs."""

from graphcp.capture.buckets import BucketSet
from graphcp.config import ModelConfig, ParallelConfig, RuntimeConfig
from graphcp.cp import InterleaveLayout, ZigzagLayout, make_layout
from graphcp.dist import CPGroup, init_from_env, launch
from graphcp.batch import ConsistencyError, ForwardInfo, PrefillOutput, Request
from graphcp.engine import PrefillEngine
from graphcp.errors import BatchError, ConfigError, GraphcpError, InputError
from graphcp.kvcache import KVCacheFull, KVHandle, KVHandleError

__all__ = [
    "BatchError",
    "BucketSet",
    "CPGroup",
    "ConfigError",
    "ConsistencyError",
    "ForwardInfo",
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
