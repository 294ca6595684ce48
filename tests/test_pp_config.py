"""Pipeline-parallel configuration and host pieces: ParallelConfig's stage split and
its errors, the micro-batch split, a stage's KV cache and checkpoint reading, and the
command-line flags (bad values: exit 2, one stderr line)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphcp import ConfigError, CPGroup, ModelConfig, ParallelConfig, PrefillEngine, RuntimeConfig
from graphcp.cli.main import main
from graphcp.kv.paged import PagedKVCache
from graphcp.model.loader import load_model
from graphcp.model.presets import PRESETS, ensure_preset, ensure_random_model
from graphcp.runtime.pp.microbatch import last_pieces, split_microbatches


def test_stage_split_and_its_errors():
    assert ParallelConfig(cp_size=2, pp_size=2).world_size == 4
    assert ParallelConfig(pp_size=2).stage_layers(4) == [range(0, 2), range(2, 4)]
    assert ParallelConfig(pp_size=3, pp_layers=[1, 3, 2]).stage_layers(6) == [range(0, 1), range(1, 4), range(4, 6)]
    st = ParallelConfig(pp_size=2, pp_layers=(3, 1)).stage(1, 4)
    assert (st.layers, st.first, st.last) == (range(3, 4), False, True)
    for kw, msg in ((dict(pp_size=0), "pp_size must be >= 1, got 0"),
                    (dict(pp_size=2, pp_layers=(4,)), r"pp_layers lists 1 stages \(\[4\]\), expected pp_size=2"),
                    (dict(pp_size=2, pp_layers=(4, 0)), r"pp_layers\[1\] \(layers of stage 1\) must be >= 1, got 0"),
                    (dict(pp_size=2, pp_layers="3,1"), "pp_layers must be a list of layer counts")):
        with pytest.raises(ConfigError, match=msg):
            ParallelConfig(**kw)
    model = ModelConfig.from_file(ensure_preset("default") / "config.json")  # 4 layers
    # layers that do not divide by the stages: the extra ones before the last stage
    model.check_parallel(ParallelConfig(pp_size=3))
    assert ParallelConfig(pp_size=3).stage_layers(4) == [range(0, 1), range(1, 3), range(3, 4)]
    assert [len(r) for r in ParallelConfig(pp_size=4).stage_layers(10)] == [2, 3, 3, 2]
    assert [len(r) for r in ParallelConfig(pp_size=4).stage_layers(11)] == [3, 3, 3, 2]
    assert [len(r) for r in ParallelConfig(pp_size=2).stage_layers(61)] == [31, 30]
    for n in range(1, 40):
        for pp in range(1, n + 1):
            counts = [len(r) for r in ParallelConfig(pp_size=pp).stage_layers(n)]
            assert sum(counts) == n and max(counts) - min(counts) <= 1 and counts[-1] == min(counts), (n, pp)
    with pytest.raises(ConfigError, match="pp_size=5 is more than num_hidden_layers=4; each pipeline stage needs"):
        model.check_parallel(ParallelConfig(pp_size=5))
    with pytest.raises(ConfigError, match=r"pp_layers=\[2, 1\] sums to 3 layers, the model has num_hidden_layers=4"):
        model.check_parallel(ParallelConfig(pp_size=2, pp_layers=(2, 1)))
    with pytest.raises(ConfigError, match="pp_size=2 x cp_size=1 needs 2 ranks, the process group has 1"):
        PrefillEngine("default", RuntimeConfig(kv_tokens=256), CPGroup(), parallel=ParallelConfig(pp_size=2))
    for kw, msg in ((dict(microbatches=0), "microbatches must be >= 1, got 0"),
                    (dict(aux_hidden_layers=(1, 1)), "aux_hidden_layers lists layer 1 twice"),
                    (dict(aux_hidden_layers="1"), "aux_hidden_layers must be a list of decoder layer indices")):
        with pytest.raises(ConfigError, match=msg):
            RuntimeConfig(**kw)


def test_microbatch_split_covers_every_token_once_in_order_and_balanced():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lens = rng.integers(1, 200, rng.integers(1, 9)).tolist()
        m = int(rng.integers(1, 10))
        mbs = split_microbatches(lens, m)
        total = sum(lens)
        assert len(mbs) == min(m, total) and all(mbs)
        stream = [(p.request, t) for mb in mbs for p in mb for t in range(p.start, p.stop)]
        assert stream == [(j, t) for j, n in enumerate(lens) for t in range(n)]  # once each, in batch order
        for mb in mbs:
            assert len({p.request for p in mb}) == len(mb)  # a request at most once per micro-batch
            assert sum(p.num_tokens for p in mb) <= total / len(mbs) * 1.25 + 1
        where = last_pieces(mbs, len(lens))
        assert all(mbs[k][i].stop == lens[j] for j, (k, i) in enumerate(where))
    # whole requests stay whole where a boundary is near the even cut; one long request is chunked
    assert [[(p.request, p.start, p.stop) for p in mb] for mb in split_microbatches([10, 11, 9, 10], 2)] == \
        [[(0, 0, 10), (1, 0, 11)], [(2, 0, 9), (3, 0, 10)]]
    assert [[(p.start, p.stop) for p in mb] for mb in split_microbatches([100], 4)] == \
        [[(0, 25)], [(25, 50)], [(50, 75)], [(75, 100)]]
    assert len(split_microbatches([2, 1], 8)) == 3  # never an empty micro-batch


def test_a_stage_caches_and_loads_only_its_layers(tmp_path):
    kv = PagedKVCache(2, 4, 16, 2, 8, torch.float32, first_layer=2)
    assert kv.layer(2).data_ptr() == kv.pool[0].data_ptr() and kv.layer(3).data_ptr() == kv.pool[1].data_ptr()
    for i in (1, 4):
        with pytest.raises(IndexError, match=f"layer {i} is not cached here: this KV cache holds layers 2..3"):
            kv.layer(i)
    # the default preset tied: the last stage's LM head is the embedding matrix
    folder = ensure_random_model("default-tied", {**PRESETS["default"], "tie_word_embeddings": True}, root=tmp_path)
    _, whole = load_model(folder, torch.float32)
    read = {0: [], 1: []}
    for s in (0, 1):
        _, part = load_model(folder, torch.float32, parallel=ParallelConfig(pp_size=2), stage=s,
                             on_tensor=read[s].append)
        layers = {int(n.split(".")[2]) for n in read[s] if n.startswith("model.layers.")}
        assert layers == ({0, 1} if s == 0 else {2, 3})
        assert ("model.embed_tokens.weight" in read[s]) and (("model.norm.weight" in read[s]) == (s == 1))
        mine = dict(part.named_parameters())
        for name, p in whole.named_parameters():
            if name.startswith("layers."):
                i = int(name.split(".")[1])
                local = f"layers.{i - 2 * s}." + name.split(".", 2)[2]
                assert (local in mine) == (i // 2 == s)
                if local in mine:
                    assert torch.equal(mine[local], p)
        assert (part.norm is not None) == (s == 1) and len(part.layers) == 2


@pytest.mark.parametrize("flags,msg", [
    (["--pp-layers", "2,1", "--pp", "2"], "--pp-layers 2,1 sums to 3 layers"),
    (["--pp", "5"], "--pp 5 is more than num_hidden_layers=4"),
    (["--pp", "2", "--pp-layers", "1,x"], "argument --pp-layers: expected comma-separated integers"),
    (["--aux-hidden-layers", "1,4"], "[1] must be a decoder layer index in [0, 4), got 4"),
    (["--pp-microbatches", "0"], "argument --pp-microbatches: expected an integer >= 1 and <= 4096, got '0'"),
])
def test_bad_pipeline_flags_are_one_line(tmp_path, capsys, flags, msg):
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    try:
        code = main(["prefill", "--input", str(req), "--output", str(tmp_path / "o.pt"), *flags])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and msg in err and "error:" in err, err
    assert not (tmp_path / "o.pt").exists()
