"""One request's KV entering the engine (``PrefillEngine.import_kv``): the export's
inverse, through the same parts.

A payload exported by any graphcp engine (any CP size, cache mode, attention TP, pipeline
split or attention DP) is checked against this engine's model and format (its
fingerprint, format, dtype and shape: one line, :class:`KVImportError`), then placed as
if this engine had prefilled the request in one forward: the cache reserves its tokens
all or nothing (the placement decides which rank holds which positions and keeps the
sharded ledger to match; a full pool is ``KVCacheFull`` with nothing changed), and each
rank's storage writes what it keeps of every layer it keeps (a layer's positions this
rank holds, its heads under attention TP, a per-request state whole), the inverse of the
export's reads. Every rank of the engine calls it (SPMD) and returns the same handle,
which ``decode``, ``generate`` and a next turn's ``prefill(prefix=...)`` accept.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.errors import BatchError
from graphcp.kv.handle import KVCacheFull, KVHandle
from graphcp.kv.spans import position_runs
from graphcp.pd.errors import KVImportError
from graphcp.pd.files import KVFile
from graphcp.runtime.batch import ConsistencyError
from graphcp.runtime.build import EngineParts
from graphcp.runtime.dp import ReplicaHandle
from graphcp.runtime.export import Exporter


@dataclass
class Importer:
    parts: EngineParts
    #: the engine's exporter: the metadata this engine's own export of a request would have
    exporter: Exporter

    def import_kv(self, exported) -> KVHandle | ReplicaHandle:
        """See :meth:`graphcp.runtime.engine.PrefillEngine.import_kv`."""
        p = self.parts
        settings = {**runtime_settings(p.runtime), **parallel_settings(p.parallel), "model": p.family.kind(p.cfg),
                    "moe": p.runtime.moe, "import": "on"}
        check_combination(settings, family=p.cfg.family, names={"import": "PrefillEngine.import_kv"})
        if isinstance(exported, (str, os.PathLike)):
            exported = KVFile(exported)  # (each rank reads only the positions it keeps)
        self.check(exported)
        if p.runtime.check_consistency:
            self._same_payload(exported)
        if p.parallel.dp_size > 1:
            return self._replica_import(exported)
        return self._place(exported)

    # ---- the checks (nothing has changed when they raise) ---------------------------
    def check(self, exported) -> None:
        """KVImportError (one line) unless ``exported`` is a payload of this engine's model
        in this engine's format and dtype, with every tensor of its metadata's shape."""
        meta = getattr(exported, "meta", None)
        if meta is None or not hasattr(exported, "tensor"):
            raise KVImportError(f"import_kv: expected a KV export (export_kv, read_kv or a KVReceiver's get), got "
                                f"{type(exported).__name__}")
        num_tokens = getattr(meta, "num_tokens", None)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise KVImportError(f"import_kv: the payload's num_tokens must be an integer >= 1, got {num_tokens!r}")
        mine = self.exporter.meta_for(num_tokens)
        model = self.parts.model_dir
        theirs = getattr(meta, "fingerprint", None)
        if theirs != mine.fingerprint:
            raise KVImportError(f"import_kv: the KV is of another model (fingerprint {theirs!r}; this engine's model "
                                f"{model} is {mine.fingerprint!r})")
        if getattr(meta, "format", None) != mine.format:
            raise KVImportError(f"import_kv: the KV is in format {getattr(meta, 'format', None)!r}; this engine's "
                                f"model keeps {mine.format!r}")
        if meta.dtype != mine.dtype:
            raise KVImportError(f"import_kv: the KV is {meta.dtype}, this engine runs {mine.dtype} (prefill and "
                                "decode in one dtype: the continuation is exact)")
        if type(meta) is not type(mine) or replace(meta, page_size=mine.page_size) != mine:
            diff = [f.name for f in fields(mine) if getattr(meta, f.name, None) != getattr(mine, f.name)
                    and f.name != "page_size"]
            raise KVImportError(f"import_kv: the payload's {diff[:1] or ['metadata']} differ from this engine's "
                                f"export of {num_tokens} tokens ({ {k: getattr(meta, k, None) for k in diff[:1]} } vs "
                                f"{ {k: getattr(mine, k) for k in diff[:1]} })")
        exported.check("import_kv")  # every tensor of its metadata's shape and dtype (KVFormatError: an InputError)
        if num_tokens > self.parts.cfg.max_position_embeddings:
            raise KVImportError(f"import_kv: {num_tokens} tokens exceed the model's context of "
                                f"{self.parts.cfg.max_position_embeddings}")

    def _same_payload(self, exported) -> None:
        """Every rank of the run was given the same payload (ConsistencyError otherwise):
        one small all-gather of its length and a checksum of its tokens and metadata."""
        world = self.parts.world
        if not world.distributed:
            return
        meta, ids = exported.meta, exported.token_ids
        fp = [meta.num_tokens, zlib.crc32(repr(sorted(meta.to_dict().items())).encode()),
              -1 if ids is None else zlib.crc32(ids.detach().cpu().numpy().astype(np.int64).tobytes())]
        every = world.all_gather_rows(torch.tensor([fp], dtype=torch.int64, device=self.parts.device)).cpu()
        differ = [r for r in range(world.size) if not torch.equal(every[r], every[world.rank])]
        if differ:
            raise ConsistencyError(f"rank {world.rank}: ranks {differ} were given another payload to import_kv "
                                   f"({meta.num_tokens} tokens here); every rank imports the same KV")

    # ---- the placement ----------------------------------------------------------------
    def _place(self, exported) -> KVHandle:
        """Reserve the request's tokens (all or nothing) and write what this rank keeps."""
        kv = self.parts.kv
        T = exported.meta.num_tokens
        ids = kv.extend([None], [T])  # KVCacheFull: nothing changed
        try:
            handle = kv.handle(ids[0])
            self._write(exported, handle)
        except BaseException:
            kv.rollback(ids, [T])
            raise
        return handle

    def _write(self, exported, handle: KVHandle) -> None:
        """Every layer this rank keeps: its positions (the placement's) of a token layer, a
        per-request state whole, each in this rank's heads under attention TP."""
        p, kv = self.parts, self.parts.kv
        meta, device = exported.meta, p.device
        held = handle.positions(kv.rank)
        positions, runs = torch.from_numpy(held), position_runs(held)
        partial = hasattr(exported, "read_runs")  # a file: read only these positions
        tp = p.mesh.attn_tp
        split = tp.size > 1 and p.family.export_splits_heads
        state_layers = kv.storage.state_layers
        for layer in kv.storage.held.held:
            whole = layer in state_layers
            values = []
            for name in meta.layer_tensors(layer):
                if whole:
                    t = exported.tensor(layer, name)
                elif partial:
                    t = exported.read_runs(layer, name, runs)
                else:
                    t = exported.tensor(layer, name)
                    t = t.index_select(meta.token_dim, positions.to(t.device))
                if split:
                    t = meta.take_heads(layer, name, t, tp.size, tp.rank)
                values.append(t.to(device))
            kv.write_import(handle, layer, tuple(values))

    def _replica_import(self, exported) -> ReplicaHandle:
        """Under attention DP: the request lands on one replica, the one with the most free
        pages (the lowest on a tie; every rank computes the same from one all-gather), and
        every rank returns its ReplicaHandle (the local handle on that replica's ranks)."""
        p = self.parts
        free = torch.tensor([[p.kv.num_free_pages]], dtype=torch.int64, device=p.device)
        every = p.mesh.dp.all_gather_rows(free).cpu().view(-1).tolist()
        replica = max(range(len(every)), key=lambda d: (every[d], -d))
        here = p.mesh.coords.dp
        local, error = None, None
        if here == replica:
            try:
                local = self._place(exported)
            except BatchError as e:  # (a full pool on the replica: every rank raises it)
                error = e
        # every rank learns whether the replica placed it (a full pool refuses everywhere)
        ok = torch.tensor([[0 if error is not None else 1]], dtype=torch.int64, device=p.device)
        placed = int(p.mesh.ffn.all_gather_rows(ok).min())
        if error is not None:
            raise error
        if not placed:
            raise KVCacheFull(f"import_kv: attention-DP replica {replica} refused the request's "
                              f"{exported.meta.num_tokens} tokens (its ranks name why); nothing was changed",
                              "kv_tokens")
        return ReplicaHandle(replica, exported.meta.num_tokens, local)
