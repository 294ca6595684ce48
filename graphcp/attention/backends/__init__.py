"""Attention backends, one module each: the torch reference (``torch_ref``), our Triton
kernel (``triton``), FlashInfer's FA2 prefill (``flashinfer``) and trtllm-gen's context
FMHA (``trtllm``). Importing this package registers each (``@register_backend``, see
:mod:`graphcp.attention.catalog`); :mod:`graphcp.attention.registry` builds them by name.
Only a backend's own module names its kernel library, and imports it only when the
backend is constructed or its kernels run, never at registration.

Each GPU backend's decode kernel (what a decode graph captures; ``register_decode_backend``)
is a module of its own beside it: ``triton_decode``, ``flashinfer_decode``, ``trtllm_decode``
(the torch reference's is graphcp.attention.decode.paged)."""

# imported for their registration, in the order the registry lists them
from graphcp.attention.backends import torch_ref, triton, flashinfer, trtllm  # noqa: F401,I001
from graphcp.attention.backends import triton_decode, flashinfer_decode, trtllm_decode  # noqa: F401,I001

__all__ = ["torch_ref", "triton", "flashinfer", "trtllm", "triton_decode", "flashinfer_decode", "trtllm_decode"]
