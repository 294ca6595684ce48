"""Pass-KV or pass-Q, chosen per batch on the host.

Per layer, a rank receives in pass-KV ``C - 1`` messages of one rank's share of the
batch's KV, new and cached: ``(C - 1) (T + P) / C`` tokens of ``2 N_KV D e`` bytes. In
pass-Q it receives ``C - 1`` query blocks, ``(C - 1) T / C`` rows of ``N_H D e``
bytes, and then, in the all-to-all that returns partial results, its own ``T / C``
rows from each of the ``C - 1`` others, outputs and float32 LSEs: ``N_H (D e + 4)``
bytes a row. A ring step attends ``T / C`` queries to ``(T + P) / C`` keys:
``4 N_H D (T / C) (T + P) / C`` FLOPs. (T: the batch's new tokens, P: its cached
tokens, e: bytes per element, F: attention FLOP/s, BW: link bytes/s a direction.)

The rule (Yang et al., "Context Parallelism for Scalable Million-Token Inference",
Meta 2024, Alg. 1 and 5, in this project's reading): pass-KV when

1. its message hides under the step's attention: ``T >= C F N_KV e / (2 N_H BW)``
   (one step's bytes over BW against its FLOPs over F: D and P cancel), or
2. it moves no more bytes than pass-Q: the miss rate ``T / (T + P)`` is at least
   ``2 N_KV / N_H`` (KV message against query message, per step) lowered by pass-Q's
   all-to-all, which doubles its bytes: ``2 N_KV D e / (N_H (2 D e + 4))`` (the
   bytes above, compared; C cancels), about ``N_KV / N_H``;

otherwise pass-Q. A fresh long prompt runs pass-KV; a short extend of a long cached
prefix runs pass-Q (its few queries travel instead of the whole prefix). The
all-to-all comes after the ring and cannot hide under attention, which is why the
second condition counts it in full.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields

from graphcp.attention.ring.hardware import HardwareSpec

log = logging.getLogger("graphcp.exchange")


@dataclass(frozen=True)
class ExchangeChoice:
    """What one forward's ring is, and the inputs and thresholds that decided it."""

    exchange: str  # "pass-kv" | "pass-q"
    reason: str  # "forced" | "hides" | "cheaper" | "pass-q"
    new_tokens: int  # T
    cached_tokens: int  # P
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cp_size: int
    elem_bytes: int
    peak_tflops: float
    link_gb_per_s: float
    hide_tokens: float  # condition 1's threshold on T
    miss_rate: float  # T / (T + P)
    miss_threshold: float  # condition 2's threshold on the miss rate

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def _of(cls, *values) -> ExchangeChoice:
        """``cls(*values)`` (every field, in order) without the frozen dataclass's
        setattr per field (~3 us for these 14; the choice is made every forward)."""
        self = object.__new__(cls)
        self.__dict__.update(zip(_FIELDS, values))
        return self


_FIELDS = tuple(f.name for f in fields(ExchangeChoice))


def hide_threshold(cp_size: int, num_heads: int, num_kv_heads: int, elem_bytes: int, hw: HardwareSpec) -> float:
    """New tokens from which pass-KV's per-step message hides under the step's attention."""
    return cp_size * hw.flops * num_kv_heads * elem_bytes / (2 * num_heads * hw.bytes_per_s)


def miss_threshold(num_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> float:
    """Miss rate from which pass-KV moves no more bytes than pass-Q with its all-to-all."""
    row = head_dim * elem_bytes
    return 2 * num_kv_heads * row / (num_heads * (2 * row + 4))


def choose_exchange(requested: str, new_tokens: int, cached_tokens: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, cp_size: int, elem_bytes: int, hw: HardwareSpec) -> ExchangeChoice:
    """The ring of one forward: ``requested`` ("pass-kv" / "pass-q") as it is, or for
    "auto" the rule of the module doc. Logged at DEBUG with its inputs."""
    hide = hide_threshold(cp_size, num_heads, num_kv_heads, elem_bytes, hw)
    miss = new_tokens / (new_tokens + cached_tokens)
    need = miss_threshold(num_heads, num_kv_heads, head_dim, elem_bytes)
    if requested != "auto":
        exchange, reason = requested, "forced"
    elif new_tokens >= hide:
        exchange, reason = "pass-kv", "hides"
    elif miss >= need:
        exchange, reason = "pass-kv", "cheaper"
    else:
        exchange, reason = "pass-q", "pass-q"
    choice = ExchangeChoice._of(exchange, reason, new_tokens, cached_tokens, num_heads, num_kv_heads, head_dim, cp_size,
                                elem_bytes, hw.peak_tflops, hw.link_gb_per_s, hide, miss, need)
    log.debug("exchange %s (%s): T=%d P=%d N_H=%d N_KV=%d C=%d e=%d; hide at T >= %.0f, miss rate %.4f vs %.4f",
              exchange, reason, new_tokens, cached_tokens, num_heads, num_kv_heads, cp_size, elem_bytes, hide, miss,
              need)
    return choice
