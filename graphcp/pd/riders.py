"""What rides after a request's KV in its Mooncake region: the token ids (int64
[num_tokens]) and the first token's logits (float32 [vocab]), so that the decode side's
first step needs no recompute (as a file's ``token_ids`` / ``last_logits``, graphcp.pd.files).

A region is ``[the KV, meta.nbytes][pad to 8][token ids][last logits]``; the ``open``
message says which of the two follow (``riders``: ``{"token_ids": n, "vocab": v}``, 0 for
none), so the receiver reserves and checks the whole region. Run rank 0 writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphcp.pd.export import KVFormatError

ID_BYTES, LOGIT_BYTES = 8, 4  # int64, float32


@dataclass(frozen=True)
class Riders:
    """How many token ids and logits follow the KV (0: none)."""

    num_tokens: int = 0
    vocab: int = 0

    @classmethod
    def of(cls, token_ids: torch.Tensor | None, last_logits: torch.Tensor | None) -> "Riders":
        return cls(0 if token_ids is None else int(token_ids.numel()),
                   0 if last_logits is None else int(last_logits.numel()))

    @classmethod
    def from_dict(cls, d: object, kv_tokens: int, source: str) -> "Riders":
        """An ``open``'s ``riders`` (absent: none); KVFormatError naming ``source`` unless the
        ids are none or one a token of the KV, and the counts are whole numbers."""
        d = {} if d is None else d
        if not isinstance(d, dict) or not all(isinstance(d.get(k, 0), int) and d.get(k, 0) >= 0
                                              for k in ("token_ids", "vocab")):
            raise KVFormatError(f"{source}: riders must be {{'token_ids': n, 'vocab': v}} of counts >= 0, got {d!r}")
        r = cls(d.get("token_ids", 0), d.get("vocab", 0))
        if r.num_tokens not in (0, kv_tokens):
            raise KVFormatError(f"{source}: {r.num_tokens} token ids for a KV of {kv_tokens} tokens")
        return r

    def to_dict(self) -> dict[str, int]:
        return {"token_ids": self.num_tokens, "vocab": self.vocab}

    @staticmethod
    def offset(kv_nbytes: int) -> int:
        """Where the riders start in a region (8-aligned: the ids are int64 views)."""
        return -(-kv_nbytes // ID_BYTES) * ID_BYTES

    @property
    def nbytes(self) -> int:
        return self.num_tokens * ID_BYTES + self.vocab * LOGIT_BYTES

    def region_bytes(self, kv_nbytes: int) -> int:
        """The whole region of a request of ``kv_nbytes`` of KV."""
        return self.offset(kv_nbytes) + self.nbytes if self.nbytes else kv_nbytes

    def pack(self, token_ids: torch.Tensor | None, last_logits: torch.Tensor | None) -> torch.Tensor:
        """Their bytes as the region holds them (uint8 [nbytes])."""
        parts = []
        if self.num_tokens:
            parts.append(as_ids(token_ids).view(torch.uint8))
        if self.vocab:
            parts.append(last_logits.detach().to("cpu", torch.float32).contiguous().view(torch.uint8).view(-1))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def views(self, region: torch.Tensor, kv_nbytes: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(token_ids, last_logits)`` as views of ``region`` (uint8, the request's whole
        region: the KV first); None for what does not ride."""
        at = self.offset(kv_nbytes)
        ids = region[at:at + self.num_tokens * ID_BYTES].view(torch.int64) if self.num_tokens else None
        at += self.num_tokens * ID_BYTES
        logits = region[at:at + self.vocab * LOGIT_BYTES].view(torch.float32) if self.vocab else None
        return ids, logits


def as_ids(token_ids) -> torch.Tensor:
    """Token ids (a tensor, an array or a list) as a contiguous int64 host tensor."""
    if torch.is_tensor(token_ids):
        return token_ids.detach().to("cpu", torch.int64).contiguous().view(-1)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64)).reshape(-1))
