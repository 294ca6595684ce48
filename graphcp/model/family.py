"""The model-family seam: one object per family owns everything that differs between
model families, and a registry picks it once from the checkpoint's ``config.json``.

A family (:class:`ModelFamily`) says which ``architectures`` entries (and ``model_type``
values) it reads, and owns:

- its settings in ``config.json`` (:meth:`~ModelFamily.read_config`), its checks
  against the parallel degrees and the run (:meth:`~ModelFamily.check_parallel`,
  :meth:`~ModelFamily.check_run`) and what it is called in the one declaration of the
  options that combine (:meth:`~ModelFamily.kind`, ``graphcp/combinations.py``);
- its layers (:meth:`~ModelFamily.build_model`) and its checkpoint's tensor table
  (:meth:`~ModelFamily.tensor_table`, read by :mod:`graphcp.model.loader`);
- the cache it needs under each cache mode and the attention that reads it
  (:meth:`~ModelFamily.cache_geometry`, :meth:`~ModelFamily.make_attention`; the cache
  itself comes from the one factory, :func:`graphcp.kv.factory.make_cache`);
- its KV export format (:meth:`~ModelFamily.export_meta`, :meth:`~ModelFamily.export_source`);
- the built-in presets it offers (:attr:`~ModelFamily.presets`, seeded random weights,
  :attr:`~ModelFamily.weights_recipe`).

The engine, the loader, pool sizing, the jobs and the command line ask
``family_of(cfg)`` and name no family. A new family is a package of its own that
defines a subclass and calls :func:`register_family` (docs/structure.md, "Adding a
model family"); the built-in ones are registered by :mod:`graphcp.model.families`.

This module imports nothing of the families or the model (the registry sits below
them: graphcp.model.config asks it); its annotations name the model's types (its config,
its model) as strings, and the lower layers' (the cache, its geometry, the attention, the
export format) by import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings
from graphcp.errors import ConfigError

if TYPE_CHECKING:  # the types the seam names (every one below the model)
    import torch

    from graphcp.attention.base import Attention
    from graphcp.attention.catalog import AttentionLimits
    from graphcp.config import RuntimeConfig
    from graphcp.kv.paged import PagedKVCache
    from graphcp.kv.spans import KVSource
    from graphcp.kv.spec import CacheGeometry
    from graphcp.pd.layout import TensorLayout


@dataclass(frozen=True)
class AttentionParts:
    """What a family's attention is built from: the model's config and this rank's (its
    head counts under attention TP), the runtime options, the device, the built model
    (its RoPE tables and stage), the cache, and the static sizes kernel backends
    preallocate for (graphcp.attention.registry)."""

    cfg: "ModelConfig"  # noqa: F821
    attn_cfg: "ModelConfig"  # noqa: F821
    runtime: RuntimeConfig
    device: torch.device
    model: "DecoderModel"  # noqa: F821
    kv: PagedKVCache
    limits: AttentionLimits


class ModelFamily:
    """One model family. A subclass sets :attr:`name` and :attr:`architectures` and
    implements the methods; instances are stateless (one per family, registered)."""

    #: the family's name (how docs and errors call it)
    name: ClassVar[str] = ""
    #: Hugging Face ``architectures`` entries -> the ``model_type`` they are (ModelConfig.family)
    architectures: ClassVar[Mapping[str, str]] = {}
    #: built-in presets: name -> config.json (written with seeded random weights on first use)
    presets: ClassVar[Mapping[str, dict]] = {}

    # ---- config.json ------------------------------------------------------------
    def read_config(self, d: dict[str, Any], model_type: str, source: str) -> "ModelConfig":  # noqa: F821
        """The whole ModelConfig of a config.json of ``model_type``; ConfigError naming
        ``source``, the key and the value otherwise."""
        raise NotImplementedError

    def kind(self, cfg) -> str:
        """What ``graphcp/combinations.py``'s model axis calls this model (dense, moe, ...)."""
        raise NotImplementedError

    def check_parallel(self, cfg, parallel, source: str, moe: str, flags: bool = False) -> None:
        """Refuse the model under ``parallel``: a mesh its kind does not combine with (the
        one declaration, graphcp/combinations.py), then shards that do not divide: its
        experts over the FFN's TP degree T as ``moe`` asks, a dense MLP's intermediate
        size over T, its heads over attention TP (:meth:`check_heads`), its layers into
        the pipeline stages. ``flags``: name the command line's flags."""
        check_combination({**parallel_settings(parallel), "model": self.kind(cfg)}, flags=flags, family=cfg.family)
        T = parallel.tp_size
        if flags:  # the flag that set T: --cp unless --tp or --dp did
            degree = "--cp" if T == parallel.cp_size else "--tp"
        else:
            degree = "cp_size" if T == parallel.cp_size else "tp_size"
        for experts in self.experts(cfg):
            experts.check_parallel(T, moe, source, cfg.hidden_size, degree, flags)
        if self.has_dense_mlp(cfg) and cfg.intermediate_size % T:
            if not flags:
                degree = f"tp_size=cp_size={T}" if T == parallel.cp_size else f"tp_size={T}"
            raise ConfigError(
                f"{source}: intermediate_size={cfg.intermediate_size} does not divide by "
                f"{f'{degree} {T}' if flags else degree}; the MLP is column/row-parallel over the stage's "
                f"{'--tp' if flags else 'tp_size'} ranks"
            )
        self.check_heads(cfg, parallel.attn_tp_size, source, flags)
        parallel.stage_layers(cfg.num_layers, source, flags)

    def experts(self, cfg) -> list:
        """The model's mixture-of-experts settings (MoeConfig), each checked against T."""
        return [] if cfg.moe is None else [cfg.moe]

    def has_dense_mlp(self, cfg) -> bool:
        """Whether some layer runs the dense MLP of ``intermediate_size`` (sharded over T)."""
        return cfg.moe is None or len(cfg.moe.layers) < cfg.num_layers

    def check_heads(self, cfg, size: int, source: str, flags: bool = False) -> None:
        """Heads split over attention TP ``size`` (graphcp.model.heads): query heads evenly,
        KV heads evenly or replicated when fewer than the ranks."""
        if size == 1:
            return
        split, change = attention_tp_names(flags)
        if cfg.num_heads % size:
            raise ConfigError(f"{source}: num_attention_heads={cfg.num_heads} does not divide by attention TP "
                              f"{size} ({split}): {change}")
        kv = cfg.num_kv_heads
        if kv % size and size % kv:
            raise ConfigError(f"{source}: num_key_value_heads={kv} neither divides by attention TP {size} nor "
                              f"divides it (KV heads split, or replicate when fewer than the ranks): {change}")

    def check_run(self, cfg, runtime, parallel, flags: bool = False) -> None:
        """Refuse what needs the model's own values to judge (a page size its entries
        do not divide, a stage boundary it cannot have); ``flags``: name the flags."""

    def attention(self, name: str, device) -> str:
        """The attention backend ``name`` stands for with this family on ``device``
        (``auto`` resolved)."""
        raise NotImplementedError

    # ---- weights ----------------------------------------------------------------
    #: the family's model (a graphcp.model.llama.DecoderModel or a subclass)
    model_class: ClassVar[type] = type(None)

    def build_model(self, cfg, dtype, parallel, rank: int, stage: int, moe: str, max_positions: int | None,
                    shard) -> "DecoderModel":  # noqa: F821
        """Rank ``rank``'s model of pipeline stage ``stage`` (built on whatever device
        is current: the loader builds it on the meta device): ``model_class`` over the
        FFN's TP degree, this rank's experts and heads (``shard``)."""
        return self.model_class(cfg, parallel.tp_size, dtype, max_positions, rank, moe,
                                parallel.stage(stage, cfg.num_layers), shard)

    def tensor_table(self, cfg, rank: int, tp: int, moe: str, shard) -> dict[str, "TensorTarget"]:  # noqa: F821
        """Every tensor the checkpoint must hold -> where it lands on this rank."""
        raise NotImplementedError

    def tensor_table_for(self, cfg, rank: int, tp: int, moe: str, shard,
                         names: frozenset[str]) -> dict[str, "TensorTarget"]:  # noqa: F821
        """The tensor table in the spelling of a checkpoint that lists ``names`` (what the
        loader reads by): a family whose checkpoints come in two spellings picks one; the
        default is :meth:`tensor_table`."""
        return self.tensor_table(cfg, rank, tp, moe, shard)

    def skips_tensor(self, cfg, name: str) -> bool:
        """A tensor the checkpoint may hold that this runtime does not use (multi-token
        prediction layers)."""
        return False

    def unexpected_hint(self, cfg, name: str) -> str:
        """Why an unexpected tensor is unexpected, when the family can tell (" (...)")."""
        return ""

    def random_weights(self, cfg, seed: int) -> dict[str, Any]:
        """Seeded Hub-named tensors of every shape the table lists (the presets' writer)."""
        raise NotImplementedError

    #: the version of :meth:`random_weights`' recipe: bump it whenever the recipe writes other
    #: bytes for the same config and seed, so that cached presets are written again
    #: (graphcp.model.presets)
    weights_recipe: ClassVar[int] = 1

    # ---- the cache and attention ------------------------------------------------
    def cache_geometry(self, cfg, runtime, kv_layout: str = "NHD") -> CacheGeometry:
        """What a token holds in this family's cache (``graphcp.kv.factory``'s geometry;
        ``cfg``: the config with this rank's head counts; ``kv_layout``: the page layout
        the attention backend reads, where the family's cache has a choice)."""
        raise NotImplementedError

    def kv_layout(self, runtime, device) -> str:
        """The page layout the chosen attention backend reads (where the cache has a choice)."""
        return "NHD"

    def make_attention(self, parts: AttentionParts, workspace: torch.Tensor | None = None) -> Attention:
        """The attention of the built model over its cache (graphcp.attention.base: a backend
        over K/V heads, or the family's own, which takes the cache): the forward's, and one
        more for each step of a ring, which may share the first's ``workspace``."""
        raise NotImplementedError

    def work_report(self, stats_per_rank: list[dict]) -> list[str]:
        """Lines on the family's own work per rank in a forward's stats (its indexer's, say),
        for the command line's summary."""
        return []

    # ---- the export -------------------------------------------------------------
    #: whether a rank's cache holds only its attention-TP share of the KV heads (an
    #: export then gathers the heads over attention TP)
    export_splits_heads: ClassVar[bool] = True

    def export_meta(self, cfg, num_tokens: int, runtime, fingerprint: str, draft_layers: int) -> TensorLayout:
        """The metadata of one request's exported KV (the export format's: graphcp-kv/1's
        KVMeta, or the family's registered format's; each a graphcp.pd.layout.TensorLayout)."""
        raise NotImplementedError

    def export_source(self, kv: PagedKVCache, model: "DecoderModel") -> KVSource:  # noqa: F821
        """What an export reads a request from (graphcp.kv.spans.KVSource): the cache,
        or a reader of its state in transformers' terms."""
        return kv


#: the environment variable naming modules that register families (comma-separated)
PLUGINS_ENV = "GRAPHCP_FAMILIES"
#: the entry-point group of installed packages' family modules
ENTRY_POINTS = "graphcp.families"

def attention_tp_names(flags: bool) -> tuple[str, str]:
    """How attention TP is made, and what to change, in the API's or the flags' names."""
    if flags:
        return "--tp / (--cp x --dp)", "change --tp or --cp"
    return "tp_size / (cp_size x dp_size)", "change tp_size or cp_size"


_BY_MODEL_TYPE: dict[str, ModelFamily] = {}
_BY_ARCHITECTURE: dict[str, str] = {}
_plugins_loaded = False


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` the one that reads its architectures and model types; a name
    another family already reads is a ValueError (a caller's bug). Registering the same
    family class again (its module imported twice) replaces it."""
    def same(other: ModelFamily) -> bool:
        return other is family or (type(other).__qualname__, type(other).__module__) == (
            type(family).__qualname__, type(family).__module__)

    taken = [a for a in family.architectures if a in _BY_ARCHITECTURE
             and not same(_BY_MODEL_TYPE[_BY_ARCHITECTURE[a]])]
    if taken:
        raise ValueError(f"register_family: {taken[0]!r} is read by another family already")
    for arch, model_type in family.architectures.items():
        _BY_ARCHITECTURE[arch] = model_type
        _BY_MODEL_TYPE[model_type] = family
    return family


def unregister_family(family: ModelFamily) -> None:
    """Forget ``family`` (a test's toy family, after the test)."""
    for arch, model_type in family.architectures.items():
        if _BY_MODEL_TYPE.get(model_type) is family:
            del _BY_MODEL_TYPE[model_type]
            _BY_ARCHITECTURE.pop(arch, None)


def load_plugins() -> None:
    """Import the modules that register families of their own, once: those named by
    ``$GRAPHCP_FAMILIES`` (comma-separated module names) and the ``graphcp.families``
    entry points of installed packages. Run on the first lookup, after graphcp has
    imported (a plugin may import graphcp's public API); ranks forked or spawned later
    look their plugins up the same way."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"${PLUGINS_ENV}: cannot import model-family module {name!r} ({e})") from None
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        ep.load()


def supported_architectures() -> dict[str, str]:
    """Every registered ``architectures`` entry -> its model type."""
    load_plugins()
    return dict(_BY_ARCHITECTURE)


def family_named(model_type: str) -> ModelFamily:
    """The family that reads ``model_type`` (ModelConfig.family)."""
    load_plugins()
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ConfigError(f"model type {model_type!r} is not supported; graphcp supports "
                          f"{sorted(_BY_ARCHITECTURE)}")
    return family


def family_of(cfg) -> ModelFamily:
    """The family of a ModelConfig."""
    return family_named(cfg.family)


def all_presets() -> dict[str, dict]:
    """Every registered family's presets, by name."""
    load_plugins()
    out: dict[str, dict] = {}
    for family in dict.fromkeys(_BY_MODEL_TYPE.values()):
        out.update(family.presets)
    return out
