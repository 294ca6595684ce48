"""``--device cuda`` checked before any rank starts (graphcp/dist.py ``check_devices``,
the command line's preflight): a torch built without CUDA, no visible GPU, or more
ranks on this machine than GPUs (one GPU a rank: NCCL refuses two ranks on one device)
is one line and exit 2 from the command line, a ConfigError from the library; no rank is
launched and no model is read. The CUDA answers are faked where this CPU torch has none."""

from __future__ import annotations

import pytest
import torch

import graphcp.dist as dist_mod
from graphcp.cli.main import main
from graphcp.dist import check_devices, init_from_env, launch
from graphcp.errors import ConfigError


@pytest.fixture
def no_rank_starts(monkeypatch):
    """Fail the test if the command reads a model or starts a rank."""
    import graphcp.jobs.preflight as args_mod  # (where preflight reads the model)
    import graphcp.jobs.spec as spec_mod

    def forbidden(*a, **k):
        raise AssertionError("reached past the up-front device check")

    monkeypatch.setattr(spec_mod, "run_ranks", forbidden)
    monkeypatch.setattr(args_mod, "resolve_model", forbidden)
    monkeypatch.setattr(dist_mod.mp, "get_context", forbidden)


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("command", ["run", "prefill"])
def test_cuda_on_a_torch_without_cuda_is_one_line(command, tmp_path, capsys, no_rank_starts):
    if torch.version.cuda is not None:
        pytest.skip("this torch is built with CUDA")
    req = tmp_path / "r.jsonl"
    req.write_text('{"tokens": [1, 2, 3]}\n')
    extra = ["--input", str(req), "--output", str(tmp_path / "o.pt")] if command == "prefill" else []
    assert main([command, "--device", "cuda", *extra]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"graphcp {command}: error: --device cuda with ")
    assert "is built without CUDA; run on the CPU (--device cpu) or install a CUDA build of torch" in err
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("flags,ranks", [(["--cp", "2"], 2), (["--cp", "1", "--tp", "2"], 2),
                                         (["--cp", "2", "--pp", "2"], 4), (["--cp", "1", "--dp", "2"], 2)])
def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(flags, ranks, monkeypatch, capsys, no_rank_starts):
    """One GPU and a mesh of several ranks: each rank would load the model and die at its
    first collective ("Duplicate GPU detected"); refused up front, naming both counts."""
    fake_gpus(monkeypatch, 1)
    assert main(["run", "--device", "cuda", *flags]) == 2
    err = _one_line(capsys)
    assert f"--device cuda with {ranks} rank(s)" in err
    assert f"{ranks} ranks on this machine but 1 GPU(s) visible; the mesh needs one GPU a rank" in err


def test_the_library_check(monkeypatch):
    check_devices("cpu", 64)  # a CPU run has no such limit
    fake_gpus(monkeypatch, 2)
    check_devices("cuda", 2)
    with pytest.raises(ConfigError, match=r"^device 'cuda': 3 ranks on this machine but 2 GPU\(s\) visible"):
        check_devices("cuda", 3)
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"^device 'cuda': no CUDA device is visible"):
        check_devices("cuda", 1)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ConfigError, match=r"^device 'cuda': this torch \(.*\) is built without CUDA"):
        check_devices("cuda", 1)


def test_launch_refuses_before_starting_a_process(monkeypatch, no_rank_starts):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"2 ranks on this machine but 1 GPU\(s\) visible"):
        launch(lambda group: None, 2, device="cuda")


def test_under_torchrun_a_node_counts_its_own_ranks(monkeypatch):
    """torchrun: WORLD_SIZE ranks over the nodes, LOCAL_WORLD_SIZE on this one; a rank
    joins only when its node has a GPU for each of its ranks, and takes GPU LOCAL_RANK."""
    fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(dist_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"4 ranks on this machine but 2 GPU\(s\) visible"):
        init_from_env("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    took = []
    monkeypatch.setattr(torch.cuda, "set_device", took.append)
    monkeypatch.setattr(dist_mod.dist, "init_process_group", lambda *a, **k: took.append(k["rank"]))
    group = init_from_env("cuda")
    assert took == [1, 5] and (group.rank, group.size) == (5, 8)
