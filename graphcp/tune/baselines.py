"""The fixed capture schedules other engines use by default, as graphcp bucket sets.

Engines list their sizes in TOKENS per forward. With CP the body runs on local
rows, so a size of t tokens becomes ``ceil(t / C)`` rows, aligned up to ``align``;
sizes that land on the same capacity collapse into one bucket.

Upper ends (the engines make them configurable; these are the choices here):
- SGLang (piecewise prefill graphs): 4..32 step 4, 48..256 step 16, 288..512 step
  32, 576..1024 step 64, 1280..4096 step 256, then step 512 up to 8192 tokens, so
  a default chunked-prefill size of 8192 is covered.
- vLLM: [1, 2, 4], multiples of 8 up to 256, then step 16 up to 512 tokens, its
  default largest capture size; longer prefills run eagerly there as here.
- TensorRT-LLM: powers of two from 1 to 128, then 256..3072 step 256.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphcp.runtime.capture.buckets import DEFAULT_PADDING_FACTOR, BucketSet, align_up

SGLANG_MAX_TOKENS = 8192
VLLM_MAX_TOKENS = 512
TRTLLM_MAX_TOKENS = 3072


def _steps(start: int, stop: int, step: int) -> list[int]:
    return list(range(start, stop + 1, step))


@dataclass(frozen=True)
class Baseline:
    name: str
    tokens: tuple[int, ...]  # sizes in tokens per forward, as the engine lists them
    note: str

    def capacities(self, cp_size: int, align: int) -> tuple[int, ...]:
        """Local-row capacities at this CP size: ceil(t / C) aligned up, deduplicated."""
        if cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {cp_size}")
        return tuple(sorted({int(align_up(-(-t // cp_size), align)) for t in self.tokens}))

    def bucket_set(self, cp_size: int, align: int = 8, padding_factor: float = DEFAULT_PADDING_FACTOR) -> BucketSet:
        return BucketSet(
            self.capacities(cp_size, align), align=align, padding_factor=padding_factor, meta={"baseline": self.name}
        )


SGLANG = Baseline(
    "sglang",
    tuple(
        _steps(4, 32, 4)
        + _steps(48, 256, 16)
        + _steps(288, 512, 32)
        + _steps(576, 1024, 64)
        + _steps(1280, 4096, 256)
        + _steps(4608, SGLANG_MAX_TOKENS, 512)
    ),
    f"4..32/4, 48..256/16, 288..512/32, 576..1024/64, 1280..4096/256, 4608..{SGLANG_MAX_TOKENS}/512 tokens",
)
VLLM = Baseline(
    "vllm",
    tuple([1, 2, 4] + _steps(8, 256, 8) + _steps(272, VLLM_MAX_TOKENS, 16)),
    f"1, 2, 4, 8..256/8, 272..{VLLM_MAX_TOKENS}/16 tokens",
)
TRTLLM = Baseline(
    "trtllm",
    tuple([2**i for i in range(8)] + _steps(256, TRTLLM_MAX_TOKENS, 256)),
    f"1..128 powers of two, 256..{TRTLLM_MAX_TOKENS}/256 tokens",
)
BASELINES: dict[str, Baseline] = {b.name: b for b in (SGLANG, VLLM, TRTLLM)}
