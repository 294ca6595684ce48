"""`graphcp profile`: per-rank traces and summaries at CP = 2 (eager and breakable
graph), summary totals against the traces, the committed summaries against the
documented command, the nsys layer (command lines, CSV), and `nvtx_range`."""

from __future__ import annotations

import json
import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# Building a model imports torch._dynamo (nn.init under a device context goes through
# torch._refs), ~3 s; import it once here so the forked ranks inherit it.
import torch._dynamo  # noqa: E402,F401

from graphcp import nvtx_ranges as profiling
from graphcp.cli.main import build_parser, main
from graphcp.nvtx_ranges import RANGES, family, nvtx_range
from graphcp.profile import cli as profile_cli
from graphcp.profile import nsys as profile_nsys

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "profiles" / "README.md"
LAYERS = 4  # the default model
EAGER_NAMES = {"prefill", "plan", "prepare", "eager_body", "kv_slots_gather", "lm_head", "measure",
               *(f"{f}[{i}]" for f in ("layer", "kv_exchange", "attention") for i in range(LAYERS))}
GRAPH_NAMES = {"prefill", "plan", "prepare", "select", "fill", "lm_head", "measure",
               *(f"attention[{i}]" for i in range(LAYERS)), *(f"segment[{i}]" for i in range(LAYERS + 1))}


def documented_commands() -> list[list[str]]:
    """The regeneration command of profiles/README.md, as argv lists for main()."""
    text = README.read_text()
    block = text.split("<!-- regenerate", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = []
    for part in block.replace("\\\n", " ").split("&&"):
        argv = shlex.split(part)
        assert argv[:3] == ["python", "-m", "graphcp"], part
        cmds.append(argv[3:])
    return cmds


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run the documented command (its own output folders): {committed folder name: out dir}."""
    out = {}
    for argv in documented_commands():
        name = Path(argv[argv.index("--out") + 1]).name
        d = tmp_path_factory.mktemp(name)
        argv = _replace(_replace(argv, "--out", str(d)), "--trace-dir", str(d))
        assert main(argv) == 0
        out[name] = d
    assert set(out) == {"cpu-cp2-eager", "cpu-cp2-breakable"}
    return out


def _names(summary_path: Path) -> set[str]:
    return {r["name"] for r in json.loads(summary_path.read_text())["ranges"]}


# ---- graphcp profile on the CPU ----------------------------------------------------------
@pytest.mark.parametrize("which, expected", [("cpu-cp2-eager", EAGER_NAMES), ("cpu-cp2-breakable", GRAPH_NAMES)])
def test_profile_writes_per_rank_traces_and_summaries(runs, which, expected):
    d = runs[which]
    for r in (0, 1):
        assert (d / f"trace_rank{r}.json").is_file()
        assert json.loads((d / f"summary_rank{r}.json").read_text())["rank"] == r
    names = _names(d / "summary.json")
    assert expected <= names
    if which == "cpu-cp2-breakable":
        assert any(re.fullmatch(r"replay\[\d+\]", n) for n in names)
        assert not any(family(n) in ("layer", "kv_exchange", "eager_body") for n in names)
    else:
        assert not any(family(n) in ("replay", "segment", "select", "fill") for n in names)
    assert {family(n) for n in names} <= set(RANGES)  # every name is in the documented scheme
    md = (d / "summary.md").read_text()
    assert "slowest rank" in md and "`prefill`" in md and "`attention[*]`" in md


@pytest.mark.parametrize("which", ["cpu-cp2-eager", "cpu-cp2-breakable"])
def test_summary_totals_add_up_with_the_traces(runs, which):
    d = runs[which]
    summary = json.loads((d / "summary.json").read_text())
    per_rank = []
    for r in (0, 1):
        # recomputed from the raw Chrome trace, independently of graphcp.profile.summary
        totals, counts = defaultdict(float), defaultdict(int)
        for ev in json.loads((d / f"trace_rank{r}.json").read_text())["traceEvents"]:
            if ev.get("ph") == "X" and ev.get("name", "").startswith("graphcp:"):
                totals[ev["name"][8:]] += ev["dur"] / 1e3
                counts[ev["name"][8:]] += 1
        rank_json = json.loads((d / f"summary_rank{r}.json").read_text())["ranges"]
        assert set(rank_json) == set(totals)
        for name, st in rank_json.items():
            assert st["count"] == counts[name]
            assert st["total_ms"] == pytest.approx(totals[name], rel=1e-9, abs=1e-9)
        per_rank.append(totals)
    fwd = [t["prefill"] for t in per_rank]
    assert summary["forward"]["per_rank_total_ms"] == pytest.approx(fwd)
    for row in summary["ranges"]:
        want = [t[row["name"]] for t in per_rank]
        assert row["per_rank_total_ms"] == pytest.approx(want)
        assert row["total_ms"] == pytest.approx(sum(want) / 2)
        assert row["slowest_total_ms"] == pytest.approx(max(want))
        assert row["share"] == pytest.approx(row["total_ms"] / (sum(fwd) / 2))
    # the forward is the top level: every other library range is inside it
    forward = summary["forward"]["total_ms"]
    for row in summary["ranges"]:
        if row["name"] not in ("prefill", "measure"):
            assert row["total_ms"] <= forward * (1 + 1e-9)


def test_breakable_segments_map_to_layers(runs):
    names = _names(runs["cpu-cp2-breakable"] / "summary.json")
    segs = sorted(int(n[8:-1]) for n in names if family(n) == "segment")
    atts = sorted(int(n[10:-1]) for n in names if family(n) == "attention")
    assert segs == list(range(len(atts) + 1))  # segment[i] leads into attention[i]; one segment after the last


def test_committed_summaries_have_the_documented_commands_ranges(runs):
    for name, d in runs.items():
        committed = ROOT / "profiles" / name
        assert (committed / "summary.md").is_file(), f"regenerate {committed} with the README command"
        assert _names(committed / "summary.json") == _names(d / "summary.json"), name
        fams = {r["name"] for r in json.loads((committed / "summary.json").read_text())["families"]}
        assert fams == {r["name"] for r in json.loads((d / "summary.json").read_text())["families"]}
        for f in committed.iterdir():
            assert f.stat().st_size < 1 << 20, f"{f} is too large to keep in profiles/"


def test_profile_workload_file_with_prefixes_cp1(tmp_path):
    """A workload file with cached prefixes, in-process at CP = 1: each forward gives its
    KV back, so the prefixes serve every pass."""
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"extend": [40, 9], "prefix": [0, 24]}\n{"extend": [17]}\n')
    out = tmp_path / "out"
    assert main(["profile", "--cp", "1", "--graph", "off", "--workload", str(wl), "--warmup", "0",
                 "--iters", "3", "--kv-tokens", "256", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["forward"]["count"] == 6 and s["config"]["batches"] == 2 and s["ranks"] == [0]
    assert (out / "trace_rank0.json").is_file() and s["captures"] == []


def test_breakable_run_reports_captures(runs):
    s = json.loads((runs["cpu-cp2-breakable"] / "summary.json").read_text())
    replayed = {r["name"].replace("replay", "capture") for r in s["ranges"] if family(r["name"]) == "replay"}
    assert replayed <= {c["name"] for c in s["captures"]}
    assert all(ms > 0 for c in s["captures"] for ms in c["per_rank_ms"])


def test_load_batches_synthetic_and_max_batches():
    args = build_parser().parse_args(["profile", "--synthetic", "short:batches=5,reqs=2", "--max-batches", "3",
                                      "--out", "x"])
    batches, desc = profile_cli.load_batches(args)
    assert len(batches) == 3 and "short" in desc
    args = build_parser().parse_args(["profile", "--out", "x"])
    assert profile_cli.load_batches(args)[0] == profile_cli.DEFAULT_BATCHES


def test_profile_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse names the flag: "argument --iters: expected an integer >= 1"
        main(["profile", "--iters", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "argument --iters: expected an integer >= 1, got '0'" in capsys.readouterr().err
    assert main(["profile", "--synthetic", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown synthetic workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--workload", "a.jsonl", "--synthetic", "short", "--out", str(tmp_path)])


# ---- the nsys layer ---------------------------------------------------------------------
def test_nsys_profile_command_line(tmp_path):
    args = build_parser().parse_args(["profile", "--device", "cuda", "--cp", "4", "--graph", "full",
                                      "--synthetic", "short:batches=8", "--out", str(tmp_path)])
    cmd = profile_nsys.profile_cmd(tmp_path, profile_cli.inner_args(args), python="python")
    line = profile_nsys.shell(cmd)
    assert cmd[:2] == ["nsys", "profile"]
    for part in ("--trace=cuda,nvtx,osrt", "--cuda-graph-trace=node", "--trace-fork-before-exec=true",
                 f"--output {tmp_path}/graphcp", "python -m graphcp profile", "--tool nvtx", "--cp 4",
                 "--graph full", "--device cuda", "--synthetic short:batches=8", f"--out {tmp_path}"):
        assert part in line, part
    # the inner arguments parse back to the same run
    inner = build_parser().parse_args(["profile", *profile_cli.inner_args(args)])
    assert profile_cli.run_config(inner, "w", []) == profile_cli.run_config(args, "w", [])
    assert inner.tool == "nvtx" and inner.memory_check
    # the run under nsys launches the ranks: --no-memory-check goes with it
    unchecked = build_parser().parse_args(["profile", "--no-memory-check", "--out", str(tmp_path)])
    assert not build_parser().parse_args(["profile", *profile_cli.inner_args(unchecked)]).memory_check


def test_nsys_stats_command_line(tmp_path):
    cmd = profile_nsys.stats_cmd(tmp_path / "graphcp.nsys-rep", tmp_path / "graphcp")
    assert profile_nsys.shell(cmd) == (f"nsys stats --report nvtx_pushpop_trace --format csv --force-export=true "
                                       f"--output {tmp_path}/graphcp {tmp_path}/graphcp.nsys-rep")
    assert profile_nsys.csv_path(tmp_path / "graphcp") == tmp_path / "graphcp_nvtx_pushpop_trace.csv"


def test_cuda_without_nsys_prints_the_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profile_nsys, "which_nsys", lambda: None)
    assert main(["profile", "--device", "cuda", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node" in out
    assert f"--from-nsys {tmp_path}/graphcp.nsys-rep" in out


def _pushpop_csv(path: Path, rows: list[tuple]) -> None:
    head = ("Start (ns),End (ns),Duration (ns),DurChild (ns),DurNonChild (ns),Name,PID,TID,Lvl,NumChild,"
            "RangeId,ParentId,RangeStack,NameTree")
    lines = [head] + [f"{s},{s + d},{d},0,{d},{n},{pid},{pid},0,0,1,,:1,{n}" for s, d, n, pid in rows]
    path.write_text("\n".join(lines) + "\n")


def test_summary_from_nsys_csv(tmp_path):
    """Two ranks (PIDs 70, 50: the map, not PID order, says which is rank 0); only
    ranges inside `measure` count; a capture outside it is reported apart."""
    rows = []
    for pid, slow in ((70, 1), (50, 2)):
        rows += [(0, 5_000_000, "graphcp:capture[256]", pid), (1_000, 2_000, "graphcp:prefill", pid),
                 (10_000_000, 9_000_000, "graphcp:measure", pid), (11_000_000, 3_000_000, "graphcp:prefill", pid),
                 (11_500_000, 1_000_000 * slow, "graphcp:attention[0]", pid), (11_600_000, 10, ":other", pid)]
    csv = tmp_path / "graphcp_nvtx_pushpop_trace.csv"
    _pushpop_csv(csv, rows)
    profile_nsys.write_rank_pids(tmp_path, [70, 50])
    assert main(["profile", "--from-nsys", str(csv), "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["name"]: r for r in s["ranges"]}
    assert set(rows) == {"prefill", "attention[0]", "measure"}
    assert rows["prefill"]["count"] == 1 and rows["prefill"]["total_ms"] == pytest.approx(3.0)
    assert rows["attention[0]"]["per_rank_total_ms"] == pytest.approx([1.0, 2.0])
    assert rows["attention[0]"]["slowest_rank"] == 1 and rows["attention[0]"]["share"] == pytest.approx(0.5)
    assert s["captures"] == [{"name": "capture[256]", "per_rank_ms": [5.0, 5.0]}]
    assert json.loads((tmp_path / "summary_rank1.json").read_text())["ranges"]["attention[0]"]["total_ms"] == 2.0


# ---- nvtx_range ---------------------------------------------------------------------------
def test_nvtx_range_names_and_categories():
    r = nvtx_range("attention[7]", category="break")
    assert nvtx_range("attention[7]") is r and r.category == "break"  # cached, category from the scheme
    with pytest.raises(ValueError, match="category 'break'"):
        nvtx_range("attention[7]", category="host")
    assert profiling.index("segment[12]") == 12 and profiling.index("prefill") is None


def test_nvtx_range_feeds_torch_profiler_and_nests(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with nvtx_range("layer[0]"):
            with nvtx_range("layer[0]"):  # a name nested in itself keeps both events
                torch.ones(2).add_(1)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    evs = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["name"] for e in evs if e.get("name", "").startswith("graphcp:")] == ["graphcp:layer[0]"] * 2


def test_nvtx_range_is_invisible_to_the_trace_recorder():
    """A capture under a recording profiler must not record the range as an op."""
    from graphcp.runtime.capture.graphs import TraceSegment

    x = torch.ones(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        seg = TraceSegment()
        seg.begin()
        with nvtx_range("layer[0]"):
            x.mul_(2)
        seg.end()
    assert [str(op.func) for op in seg._ops] == ["aten.mul_.Tensor"]
