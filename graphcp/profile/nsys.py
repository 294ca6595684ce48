"""The Nsight Systems side of ``graphcp profile``: command lines and report parsing.

Kept thin and pure so it is testable without a GPU or ``nsys``:

1. :func:`profile_cmd` re-runs ``graphcp profile --tool nvtx ...`` under
   ``nsys profile`` (the inner run only emits NVTX ranges and writes the
   rank -> PID map; nsys records).
2. :func:`stats_cmd` exports the per-range report. We read
   ``nvtx_pushpop_trace`` (one row per range, with its PID) rather than
   ``nvtx_sum``, because the summary needs each rank's totals and ``nvtx_sum``
   folds every process into one row.
3. :func:`events_from_pushpop_csv` turns that CSV into :class:`RangeEvent` per rank.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

from graphcp.errors import InputError
from graphcp.nvtx_ranges import PREFIX
from graphcp.profile.summary import RangeEvent

REPORT = "nvtx_pushpop_trace"
RANKS_FILE = "nsys_ranks.json"  # written by the inner run: {"pids": [pid of rank 0, pid of rank 1, ...]}
#: CUDA + NVTX + OS runtime; graph kernels as nodes, so a replay shows each kernel, not one opaque launch
TRACE_FLAGS = ("--trace=cuda,nvtx,osrt", "--cuda-graph-trace=node")


def which_nsys() -> str | None:
    return shutil.which("nsys")


def report_base(out_dir: str | Path) -> str:
    return str(Path(out_dir) / "graphcp")


def profile_cmd(out_dir: str | Path, inner_args: list[str], nsys: str = "nsys", python: str | None = None) -> list[str]:
    """``nsys profile ... python -m graphcp profile <inner_args>`` writing ``DIR/graphcp.nsys-rep``."""
    return [
        nsys, "profile", *TRACE_FLAGS,
        "--trace-fork-before-exec=true",  # local ranks may be forked: follow them
        "--force-overwrite=true",
        "--output", report_base(out_dir),
        python or sys.executable, "-m", "graphcp", "profile", *inner_args,
    ]


def stats_cmd(report: str | Path, out_prefix: str | Path, nsys: str = "nsys") -> list[str]:
    """Export ``nvtx_pushpop_trace`` as CSV to ``<out_prefix>_nvtx_pushpop_trace.csv``."""
    return [nsys, "stats", "--report", REPORT, "--format", "csv", "--force-export=true",
            "--output", str(out_prefix), str(report)]


def csv_path(out_prefix: str | Path) -> Path:
    return Path(f"{out_prefix}_{REPORT}.csv")


def shell(cmd: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def events_from_pushpop_csv(paths: list[str | Path], pids: list[int] | None = None) -> dict[int, list[RangeEvent]]:
    """rank -> graphcp range events, from one CSV (one nsys over all ranks) or one
    per rank (nsys under torchrun). ``pids[r]`` is rank r's process; without the
    map, processes that emitted graphcp ranges are ranked in PID order."""
    by_pid: dict[int, list[RangeEvent]] = {}
    for path in paths:
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError as e:
            raise InputError(f"cannot read nsys CSV {path}: {e}") from e
        if rows and not {"Start (ns)", "Duration (ns)", "Name", "PID"} <= set(rows[0]):
            raise InputError(f"{path}: not an {REPORT} CSV (columns {sorted(rows[0])})")
        for row in rows:
            name = row["Name"]
            if not name.startswith(PREFIX):  # nsys shows a domain's ranges as "<domain>:<message>"
                continue
            ev = RangeEvent(name[len(PREFIX):], int(row["Start (ns)"]) / 1e3, int(row["Duration (ns)"]) / 1e3)
            by_pid.setdefault(int(row["PID"]), []).append(ev)
    order = pids if pids is not None else sorted(by_pid)
    missing = [p for p in by_pid if p not in order]
    if missing:
        raise ValueError(f"graphcp ranges from processes {missing} that are not in the rank map {order}")
    return {r: by_pid.get(pid, []) for r, pid in enumerate(order)}


def read_rank_pids(out_dir: str | Path) -> list[int] | None:
    p = Path(out_dir) / RANKS_FILE
    return json.loads(p.read_text())["pids"] if p.is_file() else None


def write_rank_pids(out_dir: str | Path, pids: list[int]) -> None:
    (Path(out_dir) / RANKS_FILE).write_text(json.dumps({"pids": pids}) + "\n")
