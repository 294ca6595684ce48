"""Buckets: the local-row capacities the body is captured for, the selection rule
the runner uses, and the bucket file the tuning CLI writes.

A bucket is a capacity of local rows per rank. All ranks share the plan, so they
compute the same required capacity (the largest rank's rows) and pick the same
bucket. A batch runs eagerly when no bucket holds it, or when the chosen bucket
would pad it by more than ``padding_factor`` (capacity / required rows).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from graphcp.checks import MAX_CP, check_choice, check_float, check_int
from graphcp.errors import ConfigError
from graphcp.jsonl import other_format
from graphcp.options import LAYOUTS

DEFAULT_ALIGN = 8
DEFAULT_PADDING_FACTOR = 2.0
#: powers of two from 16 to 4096 local rows: any batch from 8 to 4096 rows fits within 2x
DEFAULT_CAPACITIES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BUCKET_FILE_VERSION = 1
#: local rows: the static buffers are sized by the largest bucket
MAX_BUCKET_CAPACITY = 1 << 20
MAX_BUCKETS_IN_SET = 4096
MAX_ALIGN = 1 << 16

# reasons a forward runs eagerly (keys of the runner's fallback counters)
FALLBACK_TOO_LARGE = "larger_than_every_bucket"
FALLBACK_PADDING = "padding_over_factor"
FALLBACK_REQUESTS = "more_requests_than_static_segments"  # full-graph mode only


def align_up(n: "int | np.ndarray", align: int):
    return -(-n // align) * align


class Selection(NamedTuple):
    """One forward's bucket choice (a tuple: made per forward, so cheap to build)."""

    required: int  # the largest rank's local rows
    capacity: int | None  # the chosen bucket, None when the forward runs eagerly
    reason: str | None = None  # why eager, one of the FALLBACK_* keys

    @property
    def graph(self) -> bool:
        return self.capacity is not None


@dataclass(frozen=True)
class BucketSet:
    capacities: tuple[int, ...] = DEFAULT_CAPACITIES
    align: int = DEFAULT_ALIGN
    padding_factor: float = DEFAULT_PADDING_FACTOR
    #: what the set was tuned for; None for the built-in schedule (fits any CP size)
    cp_size: int | None = None
    layout: str | None = None
    meta: dict = field(default_factory=dict, compare=False)
    #: the file it was loaded from (errors name it)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        caps = _check_fields("BucketSet", self.capacities, self.align, self.padding_factor, self.cp_size, self.layout,
                             self.meta)
        object.__setattr__(self, "capacities", caps)

    @property
    def largest(self) -> int:
        return self.capacities[-1]

    def select(self, required_rows: int) -> Selection:
        """Smallest capacity >= ``required_rows``, unless it pads past the factor."""
        if required_rows < 1:
            raise ValueError(f"required rows must be >= 1, got {required_rows}")
        i = bisect.bisect_left(self.capacities, required_rows)  # per forward: no numpy round trip
        if i == len(self.capacities):
            return Selection(required_rows, None, FALLBACK_TOO_LARGE)
        cap = self.capacities[i]
        if cap > self.padding_factor * required_rows:
            return Selection(required_rows, None, FALLBACK_PADDING)
        return Selection(required_rows, cap)

    def check_compatible(self, cp_size: int, layout: str) -> None:
        what = f"bucket file {self.source}" if self.source else "bucket set"
        if self.cp_size is not None and self.cp_size != cp_size:
            raise ConfigError(f"{what} was tuned for cp_size={self.cp_size}, this run has cp_size={cp_size} "
                              f"(tune for it: graphcp tune --cp {cp_size})")
        if self.layout is not None and self.layout != layout:
            raise ConfigError(f"{what} was tuned for layout={self.layout!r}, this run uses {layout!r}")

    # ---- file -----------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["capacities"] = list(self.capacities)
        del d["source"]  # where this copy came from, not part of the set
        return {"version": BUCKET_FILE_VERSION, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "BucketSet":
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"bucket file {p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                              f"{_looks(p)}; expected the JSON object `graphcp tune --output` writes") from None
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8, a huge integer
            raise ConfigError(f"cannot read bucket file {p}: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"bucket file {p}: expected a JSON object with \"capacities\" (as graphcp tune writes), "
                              f"got a {type(d).__name__}")
        if d.get("version") != BUCKET_FILE_VERSION:
            raise ConfigError(f"bucket file {p} has version {d.get('version')!r}, expected {BUCKET_FILE_VERSION}")
        if "capacities" not in d:
            raise ConfigError(f"bucket file {p}: missing \"capacities\"")
        if not isinstance(d["capacities"], list):
            raise ConfigError(f"bucket file {p}: capacities must be a list of integers, got {d['capacities']!r}"[:300])
        fields = dict(capacities=d["capacities"], align=d.get("align", DEFAULT_ALIGN),
                      padding_factor=d.get("padding_factor", DEFAULT_PADDING_FACTOR), cp_size=d.get("cp_size"),
                      layout=d.get("layout"), meta=d.get("meta", {}))
        _check_fields(f"bucket file {p}", **fields)  # names the file, not the class
        return cls(**{**fields, "capacities": tuple(fields["capacities"])}, source=str(p))


def _looks(path: Path) -> str:
    """``: this looks like a request file (...)`` when the file's first line is a line of
    one of graphcp's JSONL files (given to --buckets by mistake), else nothing."""
    try:
        first = json.loads(path.read_bytes().splitlines()[0])
    except (OSError, ValueError, IndexError, RecursionError):
        return ""
    fmt = other_format(first, ())
    return f": this looks like {fmt.looks}" if fmt is not None else ""


def check_align(align: int, name: str = "align", err: type = ConfigError, where: str | None = None) -> int:
    """Capacities are multiples of ``align``, itself a positive multiple of 8."""
    if check_int(align, name, lo=8, hi=MAX_ALIGN, where=where, err=err) % 8:
        raise err(f"{where + ': ' if where else ''}{name} must be a positive multiple of 8, got {align}")
    return align


def check_padding_factor(factor: float, name: str = "padding_factor", err: type = ConfigError,
                         where: str | None = None, hi: float | None = None) -> float:
    """Eager when the bucket exceeds ``factor`` times the rows: a factor below 1 would
    refuse even an exact fit."""
    return check_float(factor, name, lo=1, hi=hi, where=where, err=err)


def _check_fields(where: str, capacities, align, padding_factor, cp_size, layout, meta) -> tuple[int, ...]:
    """Every field of a bucket set, typed and ranged; returns the sorted capacities."""
    check_align(align, where=where)
    if isinstance(capacities, (str, bytes, dict)) or not hasattr(capacities, "__len__"):
        raise ConfigError(f"{where}: capacities must be a list of integers, got {capacities!r}"[:300])
    if not len(capacities):
        raise ConfigError(f"{where}: a bucket set needs at least one capacity")
    if len(capacities) > MAX_BUCKETS_IN_SET:
        raise ConfigError(f"{where}: {len(capacities)} capacities; expected at most {MAX_BUCKETS_IN_SET}")
    caps = tuple(sorted(check_int(c, "capacities entry", lo=1, hi=MAX_BUCKET_CAPACITY, where=where)
                        for c in capacities))
    bad = [c for c in caps if c % align]
    if bad:
        raise ConfigError(f"{where}: bucket capacities {bad} are not positive multiples of align={align}")
    if len(set(caps)) != len(caps):
        raise ConfigError(f"{where}: bucket capacities repeat: {list(capacities)}")
    check_padding_factor(padding_factor, where=where)
    if cp_size is not None:
        check_int(cp_size, "cp_size", lo=1, hi=MAX_CP, where=where)
    if layout is not None:
        check_choice(layout, "layout", LAYOUTS, where=where)
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: meta must be an object, got {type(meta).__name__}")
    return caps
