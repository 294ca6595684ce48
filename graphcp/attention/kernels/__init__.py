"""The Triton kernels and what tunes and checks them: the dense paged-prefill kernel
(``paged_prefill``, its tile settings and compile-only check), the sparse latent-attention kernel
(``sparse_latent``, likewise), and the compile + ptxas step both checks share (``compile``).
A kernel module imports ``triton`` at import: import it only once Triton is chosen."""
