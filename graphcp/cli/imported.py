"""``graphcp generate --import-kv DIR``: continue the requests whose KV another graphcp
run exported (``graphcp prefill --export-kv DIR``, at any shape), from their first tokens
(each file's ``last_logits``: no recompute), on this run's shape (docs/pd.md, "Import").

The files are read and checked before any rank starts (a truncated file, another format
or model, no first-token logits: one line, exit 2); every rank then imports each request
(``engine.import_kv``) and generates greedily after it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.dist import CPGroup, gather_object
from graphcp.jobs.spec import JobSpec, make_engine
from graphcp.model.config import ModelConfig
from graphcp.model.fingerprint import model_fingerprint
from graphcp.pd.errors import KVImportError
from graphcp.pd.files import KVFile
from graphcp.runtime.batch import Request


def check_import(spec: JobSpec, model: ModelConfig | None = None) -> None:
    """Refuse what an import does not combine with, in the flags' names (before the model
    is read: ``model`` None)."""
    rt = spec.runtime
    of_model = {} if model is None else {"model": model.kind, "moe": rt.moe}
    check_combination({**runtime_settings(rt), **parallel_settings(spec.parallel), **of_model, "import": "on"}, True,
                      model.family if model is not None else None)


def check_files(files: list[Path], model_dir: Path) -> list[int]:
    """Each file's header and tensors' shapes checked (KVFormatError naming it), of this
    model (KVImportError), with its first token's logits; each request's tokens."""
    mine = model_fingerprint(model_dir)
    lengths = []
    for f in files:
        export = KVFile(f).check()
        if export.meta.fingerprint != mine:
            raise KVImportError(f"{f}: the KV is of another model (fingerprint {export.meta.fingerprint!r}; "
                                f"{model_dir} is {mine!r})")
        if export.last_logits is None:
            raise KVImportError(f"{f}: holds no last_logits (the first token's logits, which graphcp prefill "
                                "--export-kv writes): nothing to continue from")
        lengths.append(export.meta.num_tokens)
    return lengths


def imported_generate_job(group: CPGroup, spec: JobSpec, files: list[Path], max_new: int, stop: tuple[int, ...],
                          logits: bool, with_stats: bool) -> dict | None:
    """Every rank: import each file's request (reading the positions it keeps), then
    generate after its first token."""
    engine = make_engine(group, spec)
    exports = [KVFile(f) for f in files]
    handles = [engine.import_kv(e) for e in exports]
    first = [int(e.last_logits.argmax()) for e in exports]
    tokens = [[[t]] for t in first]
    steps_logits = [[[e.last_logits.float()]] for e in exports]
    finish = [["stop" if t in stop else "length"] for t in first]
    steps = 0
    if max_new > 1:
        out = engine.generate([Request([t], prefix=h) for t, h in zip(first, handles)], max_new - 1, stop, logits)
        steps = out.steps
        for j, t in enumerate(first):
            if t in stop:  # (the first token ends it: what generate made after it is dropped)
                continue
            tokens[j][0] += out.tokens[j][0]
            finish[j] = [out.finish[j][0]]
            if logits:
                steps_logits[j][0] += list(out.logits[j][0])
    else:
        for h in handles:
            engine.release(h)
    ranks = gather_object(engine.world, engine.stats()) if with_stats else None
    if engine.world_rank != 0:
        return None
    res = {"tokens": tokens, "finish": finish, "steps": steps, "stats": ranks,
           "paths": sorted({s["path"] for s in engine.stats()["decode_steps"]}), "kv_cache": spec.runtime.kv_cache}
    if logits:
        res["logits"] = [[torch.stack(turn).contiguous() for turn in r] for r in steps_logits]
    return res
