"""One request's KV leaving the engine (graphcp.pd): its metadata in its family's export
format, and its assembly from the spans each rank holds in its cache mode, to one rank
of the run or to every rank."""

from __future__ import annotations

from dataclasses import dataclass

from graphcp.checks import check_int
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.errors import InputError
from graphcp.kv.handle import KVHandle
from graphcp.mesh import MeshCoords, coords, global_rank
from graphcp.model.fingerprint import model_fingerprint
from graphcp.pd.export import assemble, gather_stages, send_export
from graphcp.pd.heads import gather_heads, shard_meta
from graphcp.runtime.build import EngineParts
from graphcp.runtime.dp import ReplicaHandle, check_replica_handle


@dataclass
class Exporter:
    parts: EngineParts
    #: the model's fingerprint, computed on the first export
    _fingerprint: str | None = None

    def meta(self, handle: KVHandle):
        """The export metadata of one request's KV (its family's format: graphcp.pd.export's
        graphcp-kv/1, graphcp.model.dsa.export, graphcp.model.dsv4.export). An EAGLE-3 draft's
        layer follows the target's."""
        return self.meta_for(handle.num_tokens)

    def meta_for(self, num_tokens: int):
        """:meth:`meta` of a request of ``num_tokens`` tokens (what an import is checked against)."""
        p = self.parts
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(p.model_dir)
        drafts = int(p.drafter is not None)
        return p.family.export_meta(p.cfg, num_tokens, p.runtime, self._fingerprint, drafts)

    def check_handle(self, handle) -> None:
        """KVHandleError unless ``handle`` is live here (under attention DP: a ReplicaHandle,
        checked on its replica's ranks)."""
        if isinstance(handle, ReplicaHandle):
            check_replica_handle(handle, self.parts.mesh.coords.dp, self.parts.parallel.dp_size)
            if handle.local is not None:
                self.parts.kv.check_handle(handle.local)
            return
        self.parts.kv.check_handle(handle)

    def export(self, handle: KVHandle, dst: int | None):
        """See :meth:`graphcp.runtime.engine.PrefillEngine.export_kv`: ``dst`` is a rank of
        the whole run (every stage, replica, CP and attention-TP rank, numbered as
        graphcp.mesh does: as ``torch.distributed`` does)."""
        p = self.parts
        check_combination({**parallel_settings(p.parallel), "export": "on"})
        self.check_handle(handle)
        world = p.world
        if dst is not None:
            check_int(dst, f"export_kv: dst (the rank of the run's {world.size} that receives the export)", lo=0,
                      hi=world.size - 1, err=InputError)
        meta = self.meta(handle)
        if isinstance(handle, ReplicaHandle):
            out = self._replica_export(handle, meta, dst)
            return meta.make_export(out) if dst is None or world.rank == dst else None
        out = self._stage_export(handle, meta, None if dst is None else coords(dst, p.parallel))
        if p.pipeline is not None:
            stage_layers = p.parallel.stage_layers(p.cfg.num_layers)
            gather_stages(out, meta, stage_layers, p.pipeline.stage, world, p.parallel.tp_size, dst, p.device)
        return meta.make_export(out) if dst is None or world.rank == dst else None

    def _replica_export(self, handle: ReplicaHandle, meta, dst: int | None) -> list | None:
        """Under attention DP: the replica that holds the request assembles it (at ``dst``
        when ``dst`` is one of its ranks, else at its first rank), which then sends it to
        ``dst``, or broadcasts it to every rank of the run: one message."""
        p = self.parts
        here, holder = p.mesh.coords, handle.replica
        to = None if dst is None else coords(dst, p.parallel)
        root = to if to is not None and to.dp == holder else MeshCoords(here.stage, holder, 0, 0)
        out = self._stage_export(handle.local, meta, root) if here.dp == holder else None
        src = global_rank(p.parallel, 0, holder, root.cp, root.attn_tp)
        return send_export(out, meta, p.world, src, dst, p.device)

    def _stage_export(self, handle: KVHandle, meta, to: MeshCoords | None) -> list | None:
        """This stage's layers of the export on every rank of the stage (``to`` None), or
        on the rank at ``to``'s place in the stage (the others: None; the ranks of other
        replicas and, where every attention-TP rank holds every head, of other
        attention-TP ranks take no part)."""
        p = self.parts
        here = p.mesh.coords
        if to is not None and here.dp != to.dp:
            return None
        spans = p.kv_source.kv_spans(handle, p.group.size)
        if p.mesh.attn_tp.size > 1 and p.family.export_splits_heads:
            # each head shard over CP (to its rank at ``to``'s CP place), then the heads over attention TP
            shard = shard_meta(meta, p.mesh.attn_tp.size)
            out = assemble(p.kv, handle, spans, p.group, shard, None if to is None else to.cp, p.device)
            if to is not None and here.cp != to.cp:
                return None
            return gather_heads(out, p.mesh.attn_tp, meta, None if to is None else to.attn_tp)
        if to is not None and here.attn_tp != to.attn_tp:
            return None  # (each attention-TP rank holds the whole KV: one CP group assembles it)
        return assemble(p.kv_source, handle, spans, p.group, meta, None if to is None else to.cp, p.device)
