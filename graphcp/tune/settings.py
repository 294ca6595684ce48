"""The tuner's options, checked in one place: the command line, ``optimise`` and
``CostModel`` all call these, naming each value as their caller knows it (a flag
such as ``--padding-factor`` on the command line, a parameter name in the API).
Plain Python and numpy: the tuner runs without torch."""

from __future__ import annotations

from typing import Callable

from graphcp.checks import check_float, check_int
from graphcp.errors import InputError
from graphcp.runtime.capture.buckets import MAX_BUCKET_CAPACITY, check_align, check_padding_factor

MAX_BUCKETS = 1024
MAX_FACTOR = 1e6  # padding factor, eager penalty

#: how the command line names each option (the API uses the parameter names)
FLAGS = {
    "max_buckets": "--max-buckets", "align": "--align", "max_capacity": "--max-capacity",
    "padding_factor": "--padding-factor", "eager_penalty": "--eager-penalty", "bucket_cost": "--bucket-cost",
}

Names = Callable[[str], str]


def api_name(field: str) -> str:
    return field


def flag_name(field: str) -> str:
    return FLAGS[field]


def check_search(max_buckets: int, align: int, max_capacity: int | None, name: Names = api_name,
                 err: type[InputError] = InputError) -> None:
    """How many buckets, on which grid, up to which capacity."""
    check_int(max_buckets, name("max_buckets"), lo=1, hi=MAX_BUCKETS, err=err)
    check_align(align, name("align"), err)
    if max_capacity is not None:
        check_int(max_capacity, name("max_capacity"), hi=MAX_BUCKET_CAPACITY, err=err)
        if max_capacity < align:
            raise err(f"{name('max_capacity')} must be >= {name('align')} ({align}), got {max_capacity}")


def check_costs(padding_factor: float, eager_penalty: float | None, bucket_cost: float, name: Names = api_name,
                err: type[InputError] = InputError) -> None:
    """The cost model: the runner's padding factor, the price of an eager batch (>= the
    factor: see graphcp/tune/optimise.py) and of a bucket."""
    check_padding_factor(padding_factor, name("padding_factor"), err, hi=MAX_FACTOR)
    if eager_penalty is not None:
        check_float(eager_penalty, name("eager_penalty"), hi=MAX_FACTOR, err=err)
        if eager_penalty < padding_factor:
            raise err(
                f"{name('eager_penalty')} must be >= {name('padding_factor')} ({padding_factor}), got {eager_penalty}; "
                "the runner pads up to the factor rather than run eagerly: lower the padding factor instead"
            )
    check_float(bucket_cost, name("bucket_cost"), lo=0, hi=float(MAX_BUCKET_CAPACITY), err=err)
