"""Wiring an engine's parts: the mesh, the model its family builds, the cache the one
factory builds for the cache mode, the attention and the KV exchange, the body, the
batch preparer, the graphs, the draft, the one forward, the stats recorder and the decode
steps. :class:`EngineParts` is what the engine delegates to and what tools read: the one
route to each part (``engine.parts``, docs/api.md); nothing here names a model family or a
cache mode (graphcp.model.family, graphcp.kv.factory)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from graphcp.attention.base import Attention
from graphcp.attention.kv_exchange import KVExchange, make_exchange
from graphcp.attention.registry import (
    AttentionLimits,
    make_decode_attention,
    preallocates_per_request,
    registered_decode_kernel,
)
from graphcp.attention.ring.hardware import HardwareSpec
from graphcp.attention.ring.plan import RingPlanner
from graphcp.checks import check_layer_list
from graphcp.config import ParallelConfig, RuntimeConfig
from graphcp.cp import Layout, make_layout
from graphcp.dist import CPGroup
from graphcp.errors import ConfigError
from graphcp.kv import factory
from graphcp.kv.paged import PagedKVCache
from graphcp.kv.spans import KVSource
from graphcp.mesh import MeshGroups, build_mesh
from graphcp.model.communicator import LayerCommunicator
from graphcp.model.config import ModelConfig
from graphcp.model.eagle3.checkpoint import load_draft
from graphcp.model.family import AttentionParts, ModelFamily, family_of
from graphcp.model.llama import DecoderModel
from graphcp.model.loader import load_model
from graphcp.model.presets import resolve_model
from graphcp.runtime.batch import BatchPreparer
from graphcp.runtime.body import Body
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.capture.draft_graphs import DraftGraphs
from graphcp.runtime.capture.runner import GraphRunner
from graphcp.runtime.decode.decoder import Decoder
from graphcp.runtime.draft import DraftRunner
from graphcp.runtime.forward import StageForward
from graphcp.runtime.pool_size import pool_pages, pool_spec
from graphcp.runtime.pp.groups import PipelineGroups, pipeline_groups
from graphcp.runtime.stats import Recorder


@dataclass
class EngineParts:
    """One rank's engine, wired (see the module doc): ``engine.parts``, the one route to
    each part (the engine's own attributes are its methods and the run's values)."""

    model_dir: Path
    runtime: RuntimeConfig
    parallel: ParallelConfig
    family: ModelFamily
    cfg: ModelConfig
    model: DecoderModel
    mesh: MeshGroups
    #: this rank's CP group (its stage's and replica's)
    group: CPGroup
    #: the pipeline's groups and links (None without pipeline stages)
    pipeline: PipelineGroups | None
    device: torch.device
    layout: Layout
    buckets: BucketSet
    kv: PagedKVCache
    #: what an export reads a request from: the cache, or its family's reader of it
    kv_source: KVSource
    exchange: KVExchange
    body: Body
    preparer: BatchPreparer
    #: the graphs (None: RuntimeConfig.graph='off')
    runner: GraphRunner | None
    #: an EAGLE-3 draft's phase (None without RuntimeConfig.draft)
    drafter: DraftRunner | None
    #: the one forward of both phases (a prefill's drivers and the decode steps run it)
    forward: StageForward
    #: the forwards and decode steps the stats list (engine.stats())
    recorder: Recorder
    #: the decode steps: their planner (``preparer``), graphs (``graphs``) and capture
    decoder: Decoder

    @property
    def attn_cfg(self) -> ModelConfig:
        """The config with this rank's head counts (attention TP): what the cache and backends size by."""
        return self.model.attn_cfg

    @property
    def world(self) -> CPGroup:
        """Every rank of the run, numbered as graphcp.mesh does: the pipeline's (stage-major),
        or the stage's (every replica, CP and attention-TP rank: the FFN group's ranks)."""
        if self.pipeline is not None:
            return self.pipeline.world
        ffn = self.mesh.ffn
        return self.group if ffn.size == self.group.size else replace(ffn, name="run (every rank)")


def build_parts(model: str | Path, rt: RuntimeConfig, group: CPGroup, buckets: BucketSet | None,
                parallel: ParallelConfig | None) -> EngineParts:
    """Rank ``group.rank``'s engine of ``model`` (a checkpoint folder or a preset)."""
    parallel = parallel or ParallelConfig(cp_size=group.size)
    model_dir = resolve_model(model)
    device = torch.device(rt.device)
    family = _check_options(model_dir, rt, parallel, group, device)
    pipeline = pipeline_groups(group, parallel) if parallel.pp_size > 1 else None
    mesh = build_mesh(group, parallel) if pipeline is None else build_mesh(pipeline.world, parallel, pipeline.cp)
    cfg, net = load_model(model_dir, rt.torch_dtype, device, rank=mesh.ffn.rank, parallel=parallel, moe=rt.moe,
                          stage=pipeline.stage if pipeline is not None else 0, attn_rank=mesh.attn_tp.rank)
    family.check_run(cfg, rt, parallel)
    check_layer_list(rt.aux_hidden_layers, "RuntimeConfig.aux_hidden_layers", cfg.num_layers)
    draft = None if rt.draft is None else load_draft(rt.draft, cfg, net.embed_tokens, rt.torch_dtype, device,
                                                     cfg.max_position_embeddings)
    buckets = buckets or BucketSet()
    buckets.check_compatible(parallel.cp_size, rt.layout)
    layout = make_layout(rt.layout, parallel.cp_size)
    kv = _make_cache(family, cfg, net, rt, mesh.cp, device, draft is not None)
    attention, exchange = _make_attention(family, cfg, net, rt, kv, mesh.cp, device, buckets)
    body = Body(net, attention, kv, mesh.cp, device, exchange,
                LayerCommunicator(mesh.cp, mesh.attn_tp, mesh.ffn, mesh.dp), rt.decode_merge,
                lambda: _eager_decode_attention(attention, device))
    preparer = _make_preparer(layout, kv, mesh, pipeline, parallel, rt, cfg, device, attention, exchange)
    runner, drafter = _make_graphs(body, preparer, buckets, rt, cfg, draft)
    recorder = Recorder(exchange, len(net.stage.layers))
    forward = StageForward(body, runner)
    decoder = Decoder(net, kv, body, runner, mesh.ffn, rt, parallel, family.kind(cfg), forward, recorder, drafter)
    return EngineParts(model_dir, rt, parallel, family, cfg, net, mesh, mesh.cp, pipeline, device, layout, buckets, kv,
                       family.export_source(kv, net), exchange, body, preparer, runner, drafter, forward, recorder,
                       decoder)


def _check_options(model_dir: Path, rt: RuntimeConfig, parallel: ParallelConfig, group: CPGroup,
                   device: torch.device) -> ModelFamily:
    """Refuse options that do not combine before any group or weight (graphcp/combinations.py;
    ``auto`` as the family resolves it on the device)."""
    cfg = ModelConfig.from_file(model_dir / "config.json")
    family = family_of(cfg)
    cfg.check_combination(rt, parallel, family.attention(rt.attention, device))
    if parallel.pp_size == 1 and parallel.world_size != group.size:
        degree = (f"cp_size={parallel.cp_size}" if parallel.tp_size == parallel.cp_size
                  else f"tp_size={parallel.tp_size}")
        raise ConfigError(f"ParallelConfig.{degree} but the process group has {group.size} ranks")
    return family


def _make_cache(family: ModelFamily, cfg: ModelConfig, model: DecoderModel, rt: RuntimeConfig, group: CPGroup,
                device: torch.device, has_draft: bool) -> PagedKVCache:
    """This rank's cache of its stage's layers (and a draft's one more), refused up front
    when larger than the device's memory."""
    num_pages = pool_pages(rt, cfg)
    # a request's page-table width: no request outgrows the model's context (prefill checks
    # it before extend), nor the pool
    max_pages = min(num_pages - 1, -(-cfg.max_position_embeddings // rt.page_size))
    stage = model.stage.layers
    pool = pool_spec(rt, num_pages, range(stage.start, stage.stop + has_draft), group.rank, group.size, max_pages,
                     device)
    geometry = family.cache_geometry(model.attn_cfg, rt, family.kv_layout(rt, device))
    _check_pool_fits(factory.pool_bytes(rt.kv_cache, geometry, pool), num_pages, rt, device)
    return factory.make_cache(rt.kv_cache, geometry, pool)


def _check_pool_fits(need: int, num_pages: int, rt: RuntimeConfig, device: torch.device) -> None:
    """Refuse a KV pool larger than the device's memory up front (a clear error, not an
    allocator failure or the OOM killer halfway through zeroing it)."""
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # not POSIX: let the allocator decide
            return
    if need > have:
        raise ConfigError(
            f"kv_tokens={rt.kv_tokens}: a KV pool of {(num_pages - 1) * rt.page_size} tokens needs "
            f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB {device.type} memory "
            "(lower RuntimeConfig.kv_tokens)"
        )


def _make_attention(family: ModelFamily, cfg: ModelConfig, model: DecoderModel, rt: RuntimeConfig,
                    kv: PagedKVCache, group: CPGroup, device: torch.device,
                    buckets: BucketSet) -> tuple[Attention, KVExchange]:
    """The forward's attention backend and the exchange the cache mode stores and attends
    through (a ring's steps each plan their own metadata with a backend of their own;
    FlashInfer's share one float workspace)."""
    parts = AttentionParts(cfg, model.attn_cfg, rt, device, model, kv, _attention_limits(rt, kv, group, buckets, cfg))
    attention = family.make_attention(parts)
    acfg = model.attn_cfg
    exchange = make_exchange(
        kv, group, device, lambda: family.make_attention(parts, getattr(attention, "workspace", None)),
        lambda: RingPlanner(rt.exchange, acfg.num_heads, acfg.num_kv_heads, cfg.head_dim, rt.torch_dtype.itemsize,
                            HardwareSpec(rt.peak_tflops, rt.link_gb_per_s)))
    return attention, exchange


def _eager_decode_attention(attention: Attention, device: torch.device) -> Attention | None:
    """The decode kernel of a registered attention backend that takes a batch of any size
    (Triton's, the torch reference's): what an eager decode step attends with. None for a
    family's own backend and for a kernel sized per bucket (FlashInfer's, trtllm's): an
    eager step then runs the attention backend itself."""
    info = registered_decode_kernel(attention)
    return make_decode_attention(attention, device) if info is not None and info.cls.any_batch else None


def _attention_limits(rt: RuntimeConfig, kv: PagedKVCache, group: CPGroup, buckets: BucketSet,
                      cfg: ModelConfig) -> AttentionLimits:
    """Static sizes the kernel backends preallocate for (each takes what it needs)."""
    # a rank's rows hold its share of the pool's tokens (its mode says how many)
    max_rows = max(buckets.largest, kv.rows_bound(group.size))
    max_segments = 2 * rt.max_requests if rt.layout == "zigzag" else max_rows
    return AttentionLimits(
        max_segments=max_segments,
        # early and late zigzag segments both list their request's pages, empty segments one
        max_pages=2 * kv.num_pages + max_segments,
        max_pages_per_segment=-(-cfg.max_position_embeddings // rt.page_size),
        max_q_rows=max_rows,
        dtype=rt.torch_dtype,
    )


def _make_preparer(layout: Layout, kv: PagedKVCache, mesh: MeshGroups, pipeline: PipelineGroups | None,
                   parallel: ParallelConfig, rt: RuntimeConfig, cfg: ModelConfig, device: torch.device,
                   attention: Attention, exchange: KVExchange) -> BatchPreparer:
    # every stage of a pipeline (every rank of the mesh) must be given the same batch; under
    # attention DP the driver checks the whole batch over the stage (runtime/dp.py)
    consistency = pipeline.world if pipeline is not None else (
        mesh.ffn if mesh.ffn.size != mesh.cp.size and parallel.dp_size == 1 else None)
    sized = preallocates_per_request(attention.name)  # a batch may hold at most max_requests
    return BatchPreparer(layout, kv, mesh.cp, cfg.vocab_size, cfg.max_position_embeddings, device,
                         rt.check_consistency, rt.max_requests if sized else None, exchange.planner,
                         consistency_group=consistency)


def _make_graphs(body: Body, preparer: BatchPreparer, buckets: BucketSet, rt: RuntimeConfig, cfg: ModelConfig,
                 draft) -> tuple[GraphRunner | None, DraftRunner | None]:
    """The graph runner (graph modes) and an EAGLE-3 draft's phase, whose graphs follow the
    target's (they copy the draft's input layers out with the asked auxiliary ones)."""
    draft_aux = () if draft is None else tuple(
        dict.fromkeys(i for i in draft.aux_layer_ids if i not in rt.aux_hidden_layers))
    runner = None if rt.graph == "off" else GraphRunner(
        body, preparer, buckets, replace(rt, aux_hidden_layers=rt.aux_hidden_layers + draft_aux),
        cfg.max_position_embeddings)
    drafter = None if draft is None else DraftRunner(
        draft, body, body.group, body.device, None if runner is None else DraftGraphs(draft, runner))
    return runner, drafter
