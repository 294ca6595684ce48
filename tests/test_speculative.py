"""Speculative decoding with an EAGLE-3 draft (issue 47, docs/speculative.md, "Decoding").

``generate(..., draft_tokens=k)`` must give plain greedy decoding's ids token for token,
and each generated token's logits within the suite's bound of plain decoding's (the
verify row's against the decode step's), whatever the draft proposes: a random draft
(accepts almost nothing: every rejected row's K/V given back) and a draft whose weights
agree with a target that counts (accepts every proposal), one that agrees on half
the tokens (runs of every length, different in each request), on the token-sharded cache at
CP 1, 2 and 4 (4: slow), float32 and bfloat16, with a second turn after the first. The
cache's free pages after release equal those before; bad input is one line with the
cache unchanged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from eagle3_ref import draft_config, write_agreeing_draft, write_counting_target, write_draft, write_target
from helpers import rel_err

from graphcp import Conversation, PrefillEngine, Request, RuntimeConfig
from graphcp.cli.main import main
from graphcp.dist import CPGroup, launch
from graphcp.errors import BatchError, ConfigError

LENS = (7, 29, 1)
NEW = 12
K = 3
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    target = write_target(root / "target")
    counting = write_counting_target(root / "counting")
    return {"random": (str(target), str(write_draft(root / "draft"))),
            "agreeing": (str(counting), str(write_agreeing_draft(root / "agreeing", counting))),
            "partial": (str(counting), str(write_agreeing_draft(root / "partial", counting, swap=True)))}


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in LENS]


def _engine(group, target: str, draft: str, dtype: str, kv: str = "sharded", graph: str = "off",
            kv_tokens: int = 2048) -> PrefillEngine:
    return PrefillEngine(target, RuntimeConfig(dtype=dtype, kv_tokens=kv_tokens, kv_cache=kv, graph=graph, page_size=16,
                                               draft=draft), group)


def _job(group, models: dict, dtypes: tuple[str, ...]) -> dict:
    """Per draft and dtype: plain greedy and speculative generation of the same requests
    (a batch, then a two-turn conversation), the free pages before and after."""
    out = {}
    for name, (target, draft) in models.items():
        for dtype in dtypes:
            eng = _engine(group, target, draft, dtype)
            kv = eng.parts.kv
            free = kv.num_free_pages
            plain = eng.generate(_prompts(), NEW, logits=True)
            spec = eng.generate(_prompts(), NEW, logits=True, draft_tokens=K)
            conv = [Conversation([[5, 9, 200, 7], [11, 3]]), Conversation([list(range(40, 61)), [1]])]
            plain_conv = eng.generate(conv, 6)
            spec_conv = eng.generate(conv, 6, draft_tokens=2)
            out[name, dtype] = {"plain": plain, "spec": spec, "plain_conv": plain_conv.tokens,
                                "spec_conv": spec_conv.tokens, "free": (free, kv.num_free_pages),
                                "stored": kv.stored_tokens(), "steps": eng.stats()["decode_steps"]}
    return out


def _check(results: dict, where: str) -> dict:
    """Every rank's speculative tokens equal plain greedy's and their logits within bounds;
    the acceptance figures (rank 0's)."""
    figures = {}
    for (name, dtype), r in results.items():
        at = f"{where} {name} {dtype}"
        plain, spec = r["plain"], r["spec"]
        assert spec.tokens == plain.tokens, at
        assert r["spec_conv"] == r["plain_conv"], at
        worst = max(rel_err(a, b) for x, y in zip(plain.logits, spec.logits) for a, b in zip(x, y))
        assert worst < TOL[dtype], (at, worst)
        assert r["free"][0] == r["free"][1] and r["stored"] == 0, at
        verify = [s for s in r["steps"] if s.get("rows_per_request", 1) > 1]
        assert verify and all(s["rows"] == s["rows_per_request"] * (s["rows"] // s["rows_per_request"])
                              for s in verify), at
        figures[name, dtype] = spec.speculative
    return figures


def _acceptance(figures: dict) -> None:
    for dtype in {d for _, d in figures}:
        rnd, agree, part = figures["random", dtype], figures["agreeing", dtype], figures["partial", dtype]
        assert rnd["acceptance_rate"] < 0.2 and agree["acceptance_rate"] == 1.0, (dtype, rnd, agree)
        assert 0.2 < part["acceptance_rate"] < 0.9, (dtype, part)
        assert agree["steps"] < rnd["steps"] and agree["steps_saved"] > 0
        assert agree["tokens_per_step"] == pytest.approx(1 / agree["steps_per_token"])


@pytest.mark.parametrize("cp", [1, 2])
def test_speculative_equals_plain_greedy(models, cp):
    dtypes = ("float32", "bfloat16")
    res = [_job(CPGroup(), models, dtypes)] if cp == 1 else launch(_job, cp, models, dtypes)
    figures = [_check(r, f"CP {cp} rank {i}") for i, r in enumerate(res)]
    _acceptance(figures[0])
    print(f"CP {cp}:", {f"{n} {d}": {k: round(v, 3) for k, v in f.items() if isinstance(v, float)}
                        for (n, d), f in figures[0].items()})


@pytest.mark.slow
def test_speculative_equals_plain_greedy_cp4(models):
    for i, r in enumerate(launch(_job, 4, models, ("float32",))):
        _acceptance(_check(r, f"CP 4 rank {i}"))


def _modes_job(group, models: dict) -> dict:
    """The half-agreeing draft on every cache mode, graphs on (a verify
    step replays the decode graph of its rows' bucket, copying the draft's inputs out):
    plain and speculative tokens, free pages, the verify steps' paths."""
    target, draft = models["partial"]
    out = {}
    for kv in ("sharded", "replicated", "layer-split"):
        eng = _engine(group, target, draft, "float32", kv=kv, graph="breakable")
        free = eng.parts.kv.num_free_pages
        plain = eng.generate(_prompts(), NEW, logits=True)
        spec = eng.generate(_prompts(), NEW, logits=True, draft_tokens=K)
        paths = {s["path"] for s in eng.stats()["decode_steps"] if s.get("rows_per_request", 1) > 1}
        out[kv] = (plain, spec, free, eng.parts.kv.num_free_pages, eng.parts.kv.stored_tokens(), paths)
    return out


def test_every_cache_mode_gives_the_rejected_rows_back(models):
    for rank, res in enumerate(launch(_modes_job, 2, models)):
        for kv, (plain, spec, free, after, stored, paths) in res.items():
            at = f"CP 2 rank {rank} {kv}"
            assert spec.tokens == plain.tokens and free == after and stored == 0, at
            assert paths == {"graph"}, (at, paths)  # the verify steps replayed their rows' decode graphs
            worst = max(rel_err(a, b) for x, y in zip(plain.logits, spec.logits) for a, b in zip(x, y))
            assert worst < TOL["float32"], (at, worst)
            assert 0 < spec.speculative["acceptance_rate"] < 1, at


def test_bad_speculative_input_is_one_line_and_changes_nothing(models, tmp_path):
    target, draft = models["random"]
    eng = _engine(CPGroup(), target, draft, "float32", kv="replicated", kv_tokens=4608)
    kv = eng.parts.kv
    snap = kv.snapshot()
    for k, what in ((0, r"draft_tokens"), (64, r"draft_tokens"), (-1, r"draft_tokens")):
        with pytest.raises(BatchError, match=what) as e:
            eng.generate(_prompts(), 4, draft_tokens=k)
        assert "\n" not in str(e.value) and kv.snapshot() == snap
    # a verify step at the model's context: refused, nothing reserved
    ctx = eng.max_context
    h = eng.prefill([Request(np.arange(ctx - 2) % 512)]).handles[0]
    snap = kv.snapshot()
    with pytest.raises(BatchError, match=r"model's context of .*no position is left for 3 more") as e:
        eng.decode([h], [[1, 2, 3]], logits=True)
    assert "\n" not in str(e.value) and kv.snapshot() == snap
    two = eng.decode([h], [[1, 2]], logits=True)  # the last two positions: fits
    assert two.logits.shape == (1, 2, 512) and two.handles[0].num_tokens == ctx
    eng.release(two.handles[0])
    # a draft for another vocabulary
    bad = write_draft(tmp_path / "bad", config=draft_config(vocab_size=1024))
    with pytest.raises(ConfigError, match=r"vocab_size=1024, the target model has 512") as e:
        _engine(CPGroup(), target, str(bad), "float32")
    assert "\n" not in str(e.value)
    # without a draft
    plain = PrefillEngine(target, RuntimeConfig(kv_tokens=1024, graph="off"))
    with pytest.raises(BatchError, match=r"needs an engine with an EAGLE-3 draft"):
        plain.generate(_prompts(), 4, draft_tokens=2)


def test_several_rows_a_request_equal_one_at_a_time(models):
    """A step of n rows a request (every row kept), replayed from the decode graph of its
    rows' bucket, equals n one-row eager steps."""
    target, draft = models["random"]
    eng = _engine(CPGroup(), target, draft, "float32", kv="replicated", graph="breakable")
    toks = np.array([[3, 4, 5], [6, 7, 8]])
    out = eng.prefill([Request(p) for p in _prompts()[:2]])
    many = eng.decode(out.handles, toks, logits=True)
    assert many.info.path == "graph" and many.info.bucket == 8  # 6 rows
    for h in many.handles:
        eng.release(h)
    out = eng.prefill([Request(p) for p in _prompts()[:2]])
    handles, rows = out.handles, []
    for i in range(3):
        o = eng.decode(handles, toks[:, i], force_eager=True, logits=True)
        handles, rows = o.handles, rows + [o.logits]
    for h in handles:
        eng.release(h)
    assert rel_err(many.logits, torch.stack(rows, 1)) < 1e-5


def _cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "graphcp", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_the_command_generates_the_plain_tokens_in_fewer_steps(models, tmp_path, capsys):
    """``graphcp generate --draft DIR --draft-tokens K`` at CP 2 on the sharded cache: the
    tokens of the same command without a draft, the acceptance in OUT.pt and on stdout;
    ``--draft-tokens 0``, over the bucket limit, or without ``--draft``: exit 2, one line."""
    target, draft = models["partial"]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in _prompts()))
    common = ["--input", str(tmp_path / "r.jsonl"), "--model", target, "--cp", "2", "--kv-cache", "sharded",
              "--kv-tokens", "1024", "--max-new-tokens", "10", "--no-memory-check"]
    plain = _cli("generate", *common, "--output", str(tmp_path / "plain.pt"))
    assert plain.returncode == 0, plain.stderr
    spec = _cli("generate", *common, "--output", str(tmp_path / "spec.pt"), "--draft", draft, "--draft-tokens", "3")
    assert spec.returncode == 0, spec.stderr
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "spec.pt")
    assert got["tokens"] == want["tokens"]
    s = got["speculative"]
    assert s["draft_tokens"] == 3 and 0 < s["acceptance_rate"] < 1 and s["steps_saved"] > 0
    assert "speculative: 3 draft tokens a step, acceptance rate" in spec.stdout
    for extra, match in ((["--draft", draft, "--draft-tokens", "0"], r"--draft-tokens: expected an integer >= 1"),
                         (["--draft", draft, "--draft-tokens", "64"], r"--draft-tokens 64 is over the largest"),
                         (["--draft-tokens", "2"], r"--draft-tokens 2 needs --draft DIR")):
        try:
            rc = main(["generate", *common, "--output", str(tmp_path / "bad.pt"), *extra])
        except SystemExit as e:  # (argparse's refusal of a flag's value)
            rc = e.code
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(match, err), err
        assert not (tmp_path / "bad.pt").exists()


def _redraft_job(group, models: dict) -> list:
    """Three rounds with the half-agreeing draft (runs of every length), then
    each request's draft state against a prefill of the whole sequence with the draft: the
    re-run over the kept rows must leave the draft's K/V a prefill writes."""
    from types import SimpleNamespace

    from graphcp.runtime.decode.speculative import SpeculativeStats, first_proposals, speculative_round

    target, draft = models["partial"]
    eng = _engine(group, target, draft, "float32")
    prompts = _prompts()
    out = eng.prefill([Request(p) for p in prompts])
    live = [SimpleNamespace(handle=h, pending=int(t), logits=[[]]) for h, t in
            zip(out.handles, out.last_logits.argmax(-1).tolist())]
    seqs = [list(p) + [s.pending] for p, s in zip(prompts, live)]
    props = first_proposals(out)
    for _ in range(3):
        got = speculative_round(eng, live, props, K, np.full(len(live), 100), frozenset(), SpeculativeStats(K), False)
        for seq, g in zip(seqs, got):
            seq += g
    for s in live:
        eng.release(s.handle)
    fresh = _engine(group, target, draft, "float32")
    ref = fresh.prefill([Request(seq[:-1]) for seq in seqs], draft_next=[seq[-1] for seq in seqs])
    return [(p.first, p.hidden.float().cpu()) for p in props], first_proposals(ref), ref.draft.hidden


@pytest.mark.parametrize("cp", [1, 2])
def test_the_redraft_leaves_the_drafts_kv_a_prefill_writes(models, cp):
    res = [_redraft_job(CPGroup(), models)] if cp == 1 else launch(_redraft_job, cp, models)
    for mine, ref, hidden in res:
        assert [m[0] for m in mine] == [r.first for r in ref]
        assert rel_err(torch.stack([m[1] for m in mine]), hidden) < 1e-4
