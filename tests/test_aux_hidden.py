"""Auxiliary hidden states (the input of an EAGLE-3-style draft model): for each
request, the output of the asked decoder layers for every new token, in token
order, equal to transformers' ``output_hidden_states`` (the output of layer l is
``hidden_states[l + 1]``; for the last layer, the decoder layer's own output
before the final norm). At CP 1, 2 and 4, zigzag and interleave, graph off and
breakable (the copies inside the captured segments), with prefix extends (only the
new tokens' states come back), and with PP 2; plus the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cp_utils import rel_err

from graphcp import BatchError, ConfigError, ParallelConfig, PrefillEngine, Request, RuntimeConfig
from graphcp.dist import CPGroup, launch
from graphcp.model.presets import ensure_preset
from graphcp.runtime.capture.buckets import BucketSet
from graphcp.runtime.engine import prefill_after_prefixes

AUX = (3, 0, 2)  # the last layer included, out of order: the columns come back as asked
LENS = [70, 1, 5, 20]
PREFIX = [0, 0, 33, 4]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
BUCKETS = BucketSet((16, 32, 64, 128), padding_factor=64.0)
#: (cp, layout, graph, dtype, pp) per launch size
CASES = {
    1: [(1, "zigzag", "off", "float32", 1), (1, "zigzag", "breakable", "float32", 1),
        (1, "interleave", "off", "float32", 1)],
    2: [(2, "zigzag", "off", "float32", 1), (2, "zigzag", "breakable", "float32", 1),
        (2, "interleave", "off", "float32", 1), (2, "zigzag", "breakable", "bfloat16", 1),
        (1, "zigzag", "breakable", "float32", 2), (1, "zigzag", "off", "bfloat16", 2)],
    4: [(4, "zigzag", "breakable", "float32", 1), (4, "interleave", "off", "float32", 1),
        (2, "zigzag", "off", "float32", 2)],
}


def _batch():
    rng = np.random.default_rng(11)
    return [(rng.integers(0, 8192, p) if p else None, rng.integers(0, 8192, n)) for n, p in zip(LENS, PREFIX)]


def _job(group, cases):
    out = []
    for cp, layout, graph, dtype, pp in cases:
        rt = RuntimeConfig(dtype=dtype, layout=layout, graph=graph, kv_tokens=2048, aux_hidden_layers=AUX)
        eng = PrefillEngine("default", rt, group, BUCKETS, ParallelConfig(cp_size=cp, pp_size=pp))
        res = prefill_after_prefixes(eng, _batch(), microbatches=2 if pp > 1 else 1)
        bitwise = _replay_bitwise(eng) if graph != "off" else None
        out.append((res.aux_hidden, res.info.path, bitwise))
    return out


def _replay_bitwise(eng) -> bool:
    """The auxiliary rows a replay copied equal, bitwise, those of the same body run
    eagerly on the same bucket."""
    prep = eng.parts.preparer.prepare([Request(np.arange(40)), Request(np.arange(3))])
    try:
        rows = eng.parts.runner.prefill.synthetic_input(prep, np.random.default_rng(0))
        cap = eng.parts.runner.select(prep.plan.max_local_rows).capacity
        if cap not in eng.parts.runner.graphs:
            eng.parts.runner.capture_bucket(cap)
        eng.parts.runner.eager_on_bucket(prep, cap, rows)
        want = eng.parts.runner.aux_rows(cap).clone()
        eng.parts.runner.try_replay(prep, rows)
        return bool(torch.equal(eng.parts.runner.aux_rows(cap), want))
    finally:
        eng.parts.preparer.abort(prep)


@pytest.fixture(scope="module")
def reference():
    """transformers' states of the asked layers for each request's new tokens,
    [new, len(AUX) * hidden], per dtype."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(ensure_preset("default"), dtype=getattr(torch, dtype)).eval()
        last = len(hf.model.layers) - 1
        got = {}
        hook = hf.model.layers[last].register_forward_hook(lambda mod, args, out: got.update(out=out))
        per_request = []
        with torch.inference_mode():
            for prefix, new in _batch():
                full = new if prefix is None else np.concatenate([prefix, new])
                states = hf(torch.as_tensor(full)[None], output_hidden_states=True).hidden_states
                # the last layer's own output: hidden_states[L] is after the final norm
                cols = [got["out"][0] if i == last else states[i + 1][0] for i in AUX]
                per_request.append(torch.cat([c[-len(new):].float() for c in cols], dim=-1))
        hook.remove()
        refs[dtype] = per_request
    return refs


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_aux_hidden_equals_transformers(reference, ranks):
    cases = CASES[ranks]
    results = [_job(CPGroup(), cases)] if ranks == 1 else launch(_job, ranks, cases)
    for rank, per_case in enumerate(results):
        for (cp, layout, graph, dtype, pp), (aux, path, bitwise) in zip(cases, per_case):
            where = f"rank {rank}: CP {cp} x PP {pp}, {layout}, graph={graph}, {dtype}"
            assert [tuple(x.shape) for x in aux] == [(n, len(AUX) * 256) for n in LENS], where
            for j, (got, want) in enumerate(zip(aux, reference[dtype])):
                assert got.dtype == torch.float32
                assert rel_err(got, want) <= TOL[dtype], f"{where}, request {j}: {rel_err(got, want):.3g}"
            if graph != "off":
                assert path == "graph" and bitwise, where


def test_a_subset_or_none_per_call_and_the_errors(reference):
    rt = RuntimeConfig(graph="breakable", kv_tokens=2048, aux_hidden_layers=AUX, verify_capture=False)
    eng = PrefillEngine("default", rt, None, BucketSet((64, 128), padding_factor=64.0))
    hidden = 256
    out = prefill_after_prefixes(eng, _batch(), aux_hidden_layers=[2])  # a subset of the captured layers
    assert out.info.path == "graph"
    for captured in eng.parts.runner.graphs.values():  # the copies add no break: one per layer (attention), as without
        assert (len(captured.graph.segments), len(captured.graph.breaks)) == (5, 4)
    for got, want in zip(out.aux_hidden, reference["float32"]):
        assert rel_err(got, want[:, 2 * hidden:]) <= TOL["float32"]
    assert prefill_after_prefixes(eng, _batch(), aux_hidden_layers=[]).aux_hidden is None
    before = eng.parts.kv.snapshot()
    for layers, msg in (([1], "layer 1, which the graphs do not copy"),
                        ([4], r"aux_hidden_layers\[0\] must be a decoder layer index in \[0, 4\), got 4"),
                        ([0, 0], "lists layer 0 twice"), ([-1], r"in \[0, 4\), got -1")):
        with pytest.raises(BatchError, match=msg):
            eng.prefill([Request(np.arange(5))], aux_hidden_layers=layers)
    assert eng.parts.kv.snapshot() == before  # refused before anything changed
    # graph off: any layer per call
    eager = PrefillEngine("default", RuntimeConfig(kv_tokens=2048))
    out = eager.prefill([Request(np.arange(5))], aux_hidden_layers=[1])
    assert out.aux_hidden[0].shape == (5, hidden) and eager.prefill([Request(np.arange(3))]).aux_hidden is None
    with pytest.raises(ConfigError, match=r"RuntimeConfig.aux_hidden_layers\[1\] must be a decoder layer index "
                                          r"in \[0, 4\), got 7"):
        PrefillEngine("default", RuntimeConfig(kv_tokens=2048, aux_hidden_layers=(0, 7)))
