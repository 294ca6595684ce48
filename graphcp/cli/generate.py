"""``graphcp generate``: greedy generation of a JSONL file's requests and conversations
(docs/decode.md, docs/cli.md).

Each line is a request as ``graphcp prefill`` reads it, ``{"tokens": [ids...], "prefix":
K}`` (one turn), or a conversation, ``{"turns": [[ids...], [ids...], ...],
"max_new_tokens": N}`` (each turn prefilled after the previous turn's generated tokens;
``max_new_tokens`` overrides the flag for its turns). OUT.pt (``torch.save``) holds
``"tokens"``: per request, in input order, a list per turn of the generated ids;
``"finish"``: per request and turn, ``stop`` or ``length``; with ``--save-logits``,
``"logits"`` in the same nesting, each a float32 ``[steps, vocab]`` tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from graphcp.checks import check_output_path
from graphcp.cli.commands import write_outputs
from graphcp.cli.imported import check_files, check_import, imported_generate_job
from graphcp.cli.requests import FileConversation, check_context
from graphcp.combinations import check as check_combination
from graphcp.combinations import parallel_settings, runtime_settings
from graphcp.dist import CPGroup, gather_object
from graphcp.errors import InputError
from graphcp.jobs.memory import check_local_ranks_fit, job_memory
from graphcp.jobs.preflight import job_spec, preflight
from graphcp.jobs.spec import JobSpec, make_engine, run_job_on_ranks
from graphcp.model.config import ModelConfig
from graphcp.model.presets import resolve_model
from graphcp.runtime.batch import check_vocabulary
from graphcp.runtime.decode.generate import Conversation, stop_tokens
from graphcp.runtime.stats import write_stats


def check_conversations(convs: list[FileConversation], max_new: int, vocab: int, context: int) -> None:
    """What generate would refuse, before any rank starts, naming the file and line: a token
    outside the vocabulary, turns and their generated tokens past the model's context."""
    for c in convs:
        check_vocabulary([np.asarray(t, dtype=np.int64) for t in c.turns], vocab, lambda i, c=c: f"{c.where}, turn {i}")
        check_context(c.where, sum(len(t) for t in c.turns), context, len(c.turns), c.max_new_tokens or max_new)


def generate_job(group: CPGroup, spec: JobSpec, convs: list[FileConversation], max_new: int, stop: tuple[int, ...],
                 logits: bool, with_stats: bool, draft_tokens: int | None = None) -> dict | None:
    engine = make_engine(group, spec)
    out = engine.generate([Conversation(c.turns, c.max_new_tokens, c.prefix) for c in convs], max_new, stop, logits,
                          progress=engine.world_rank == 0, draft_tokens=draft_tokens)
    ranks = gather_object(engine.world, engine.stats()) if with_stats else None  # every rank takes part
    if engine.world_rank != 0:
        return None
    steps = engine.stats()["decode_steps"]
    res = {"tokens": out.tokens, "finish": out.finish, "steps": out.steps, "stats": ranks,
           "paths": sorted({s["path"] for s in steps}), "kv_cache": spec.runtime.kv_cache,
           "speculative": out.speculative}
    if logits:
        res["logits"] = [[x.float().contiguous() for x in turn] for turn in out.logits]
    return res


def cmd_generate(args) -> int:
    check_output_path(args.output, "--output")  # before any work
    if args.stats:
        check_output_path(args.stats, "--stats")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    spec = job_spec(args)
    check_draft_tokens(args, spec)
    imported = args.import_kv is not None
    if imported:
        check_import(spec)
    check_decode(spec)  # what the flags alone refuse, before the model (or a --draft) is read
    convs = args.requests  # read with the flags (graphcp.cli.inputs): the KV files with --import-kv
    model = preflight(spec, args.moe, f"graphcp {args.command}")
    if imported:
        check_import(spec, model)
    check_decode(spec, model)
    stop = tuple(sorted(stop_tokens(args.stop, model.vocab_size, "--stop")))
    if imported:
        lengths = check_files(convs, resolve_model(spec.model, "--model"))
        for f, n in zip(convs, lengths):
            check_context(str(f), n + 1, model.max_position_embeddings, 1, args.max_new_tokens)
        if args.memory_check:
            check_local_ranks_fit(spec, job_memory(spec, [sum(lengths)]))
        res = run_job_on_ranks(imported_generate_job, spec, convs, args.max_new_tokens, stop, args.save_logits,
                               bool(args.stats))
    else:
        check_conversations(convs, args.max_new_tokens, model.vocab_size, model.max_position_embeddings)
        if args.memory_check:  # the prompts' prefill
            check_local_ranks_fit(spec, job_memory(spec, [sum(len(t) for c in convs for t in c.turns)]))
        res = run_job_on_ranks(generate_job, spec, convs, args.max_new_tokens, stop,
                               args.save_logits, bool(args.stats), args.draft_tokens)
    out = {"tokens": res["tokens"], "finish": res["finish"]}
    spec_stats = res.get("speculative")
    if spec_stats is not None:
        out["speculative"] = spec_stats
    if args.save_logits:
        out["logits"] = res["logits"]
    files = {args.output: lambda tmp: torch.save(out, tmp)}
    if args.stats:
        files[args.stats] = lambda tmp: write_stats(tmp, res["stats"])
    write_outputs(files)
    made = sum(len(t) for r in res["tokens"] for t in r)
    what = (f"{len(convs)} imported requests" if imported else
            f"{len(convs)} requests ({sum(len(c.turns) for c in convs)} turns)")
    print(f"generated {made} tokens for {what} in "
          f"{res['steps']} decode steps on {spec.parallel.world_size} rank(s), {res['kv_cache']} KV cache, decode "
          f"path {'/'.join(res['paths']) or '-'} -> {args.output}" + (f" (stats: {args.stats})" if args.stats else ""))
    if spec_stats is not None:
        print(f"speculative: {spec_stats['draft_tokens']} draft tokens a step, acceptance rate "
              f"{spec_stats['acceptance_rate']:.2f}, {spec_stats['tokens_per_step']:.2f} tokens a request and step, "
              f"{spec_stats['steps_saved']} of {spec_stats['plain_steps']} decode steps saved")
    return 0


def check_draft_tokens(args, spec: JobSpec) -> None:
    """``--draft-tokens``: with a --draft, at most the largest decode bucket less one (a
    request's verify rows fit a decode graph); InputError (exit 2) otherwise."""
    k = args.draft_tokens
    if k is None:
        return
    if args.draft is None:
        raise InputError(f"--draft-tokens {k} needs --draft DIR (an EAGLE-3 draft to propose the tokens)")
    if args.import_kv is not None:
        raise InputError("--draft-tokens with --import-kv: an imported request carries no draft state; drop "
                         "--draft-tokens")
    most = max(spec.runtime.decode_buckets) - 1
    if k > most:
        raise InputError(f"--draft-tokens {k} is over the largest --decode-buckets less one ({most}): a request's "
                         f"verify rows (K + 1) must fit a decode bucket")


def check_decode(spec: JobSpec, model: ModelConfig | None = None) -> None:
    """Refuse what decode does not combine with (graphcp/combinations.py), in the flags'
    names; ``model``: None before it is read (its kind refuses nothing yet)."""
    rt = spec.runtime
    of_model = {} if model is None else {"model": model.kind, "moe": rt.moe}
    check_combination({**runtime_settings(rt), **parallel_settings(spec.parallel), **of_model, "decode": "on"}, True,
                      model.family if model is not None else None)
