"""graphcp: a context-parallel prefill runtime with per-bucket breakable graphs."""

from graphcp.capture.buckets import BucketSet
from graphcp.config import ModelConfig, ParallelConfig, RuntimeConfig
from graphcp.cp import InterleaveLayout, ZigzagLayout, make_layout
from graphcp.dist import CPGroup, init_from_env, launch
from graphcp.engine import PrefillEngine, PrefillOutput, Request
from graphcp.kvcache import KVHandle

__all__ = [
    "BucketSet",
    "CPGroup",
    "InterleaveLayout",
    "KVHandle",
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
