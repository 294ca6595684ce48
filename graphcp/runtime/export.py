"""One request's KV leaving the engine (graphcp.pd): its metadata in its family's export
format, and its assembly from the spans each rank holds in its cache mode, to one rank
of the run or to every rank."""

from __future__ import annotations

from dataclasses import dataclass

from graphcp.checks import check_int
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.errors import InputError
from graphcp.kv.paged import KVHandle
from graphcp.mesh import MeshCoords, coords
from graphcp.model.fingerprint import model_fingerprint
from graphcp.pd.export import assemble, gather_stages
from graphcp.pd.heads import gather_heads, shard_meta
from graphcp.runtime.build import EngineParts


@dataclass
class Exporter:
    parts: EngineParts
    #: the model's fingerprint, computed on the first export
    _fingerprint: str | None = None

    def meta(self, handle: KVHandle):
        """The export metadata of one request's KV (its family's format: graphcp.pd.export's
        graphcp-kv/1, graphcp.model.dsa.export, graphcp.model.dsv4.export). An EAGLE-3 draft's
        layer follows the target's."""
        p = self.parts
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(p.model_dir)
        drafts = int(p.drafter is not None)
        return p.family.export_meta(p.cfg, handle.num_tokens, p.runtime, self._fingerprint, drafts)

    def export(self, handle: KVHandle, dst: int | None):
        """See :meth:`graphcp.runtime.engine.PrefillEngine.export_kv`: ``dst`` is a rank of
        the whole run (every stage, replica, CP and attention-TP rank, numbered as
        graphcp.mesh does: as ``torch.distributed`` does)."""
        p = self.parts
        check_combination({**parallel_settings(p.parallel), "export": "on"})
        p.kv.check_handle(handle)
        world = p.world
        if dst is not None:
            check_int(dst, f"export_kv: dst (the rank of the run's {world.size} that receives the export)", lo=0,
                      hi=world.size - 1, err=InputError)
        meta = self.meta(handle)
        out = self._stage_export(handle, meta, None if dst is None else coords(dst, p.parallel))
        if p.pipeline is not None:
            stage_layers = p.parallel.stage_layers(p.cfg.num_layers)
            gather_stages(out, meta, stage_layers, p.pipeline.stage, world, p.parallel.tp_size, dst, p.device)
        return meta.make_export(out) if dst is None or world.rank == dst else None

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
