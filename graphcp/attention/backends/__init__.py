"""Attention backends, one module each (imported only when chosen, by
:mod:`graphcp.attention.registry`): the torch reference (``torch_ref``), our Triton
kernel (``triton``), FlashInfer's FA2 prefill (``flashinfer``) and trtllm-gen's context
FMHA (``trtllm``). Only a backend's own module imports its kernel library."""
