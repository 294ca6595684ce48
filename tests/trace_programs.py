"""Random small programs for the trace backend's fidelity property test.

A program is a list of instructions over a register file of 64-element tensors
(``[8, 8]`` or ``[64]``, float32 / bfloat16 / float16, contiguous or not) plus
int64 permutations used as indices. The op kinds are those the model and the
attention backends use, and the traps of replaying a recorded op log: casts both
ways (``to``/``float``/``type_as``, which arrive as may-alias ``aten.to.dtype``
under inference mode), ``reshape``/``flatten``/``view`` of contiguous and
non-contiguous tensors, ``contiguous``, ``transpose``, ``expand`` feeding an
in-place write, ``index_select``/``index_copy_``/``scatter_``, cross-dtype
``copy_``, ``out=`` forms, matmul/linear, softmax, in-place ops on views, and a
collective when a CP group is given.

``check(program, ...)`` records a program once, overwrites its inputs with fresh
values, replays, and compares every register bitwise with an eager run of the
same program on the same fresh values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

N = 8
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
KINDS = (
    "to", "float", "type_as", "reshape", "flatten", "view", "contiguous", "transpose", "inplace_view",
    "expand_write", "index_select", "index_copy_", "scatter_", "copy_", "out_add", "out_mm", "matmul",
    "linear", "softmax", "tanh", "binary",
)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Instr:
    kind: str
    a: int  # register operands (indices into the float registers)
    b: int
    idx: int  # index register
    param: int  # kind-specific choice (a dtype, a slice, an op)


@dataclass(frozen=True)
class Program:
    seed: int
    input_dtypes: tuple
    num_index: int
    instrs: tuple

    def inputs(self, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Fresh input values (floats in [-2, 2), permutations), the same for a seed."""
        g = torch.Generator().manual_seed(seed)
        floats = [(torch.rand(N, N, generator=g) * 4 - 2).to(d) for d in self.input_dtypes]
        # one input starts transposed: a non-contiguous tensor the program did not make
        floats[0] = floats[0].t()
        index = [torch.randperm(N, generator=g) for _ in range(self.num_index)]
        return floats, index

    def run(self, floats: list[torch.Tensor], index: list[torch.Tensor], group=None) -> list[torch.Tensor]:
        regs = list(floats)
        for ins in self.instrs:
            out = _apply(ins, regs, index, group)
            if out is not None:
                regs.append(out)
        return regs


def _m(x: torch.Tensor) -> torch.Tensor:
    """The [8, 8] form of a register (1-D registers are always contiguous)."""
    return x if x.dim() == 2 else x.view(N, N)


def _src(x: torch.Tensor) -> torch.Tensor:
    """The source of an in-place write: a copy, since it may overlap the target."""
    return _m(x).clone()


def _wire(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float32/bfloat16 form for a collective (what gloo reduces)."""
    x = _m(x).contiguous()
    return x.float() if x.dtype == torch.float16 else x


def _apply(ins: Instr, regs: list[torch.Tensor], index: list[torch.Tensor], group) -> torch.Tensor | None:
    a, b = regs[ins.a], regs[ins.b]
    idx = index[ins.idx]
    k, p = ins.kind, ins.param
    if k == "to":
        return a.to(FLOATS[p % 3])
    if k == "float":
        return a.float()
    if k == "type_as":
        return a.type_as(b)
    if k == "reshape":
        return a.reshape(N * N) if p % 2 else _m(a).t().reshape(N, N)
    if k == "flatten":
        return _m(a).t().flatten() if p % 2 else a.flatten()
    if k == "view":
        return a.view(-1) if a.is_contiguous() else a.view(a.shape)
    if k == "contiguous":
        return _m(a).t().contiguous() if p % 2 else a.contiguous()
    if k == "transpose":
        return _m(a).transpose(0, 1)
    if k == "inplace_view":
        m = _m(a)
        if p % 3 == 0:
            m[2:6].mul_(0.5)
        elif p % 3 == 1:
            m.t()[p % N].add_(1.0)
        else:
            m[:, ::2].sub_(_src(b)[:, 1::2].to(m.dtype))
        return None
    if k == "expand_write":
        m = _m(a)
        if p % 2:
            m.copy_(_src(b)[:1].expand(N, N))
        else:
            m.add_(_src(b)[:, :1].expand(N, N).to(m.dtype))
        return None
    if k == "index_select":
        return _m(a).index_select(p % 2, idx)
    if k == "index_copy_":
        _m(a).index_copy_(0, idx, _src(b).to(a.dtype))
        return None
    if k == "scatter_":
        _m(a).scatter_(1, idx.view(1, N).expand(N, N), _src(b).to(a.dtype))
        return None
    if k == "copy_":
        _m(a).copy_(_src(b))  # across dtypes when they differ
        return None
    if k == "out_add":
        buf = torch.zeros(N, N, dtype=a.dtype)
        torch.add(_m(a), _m(b).to(a.dtype), alpha=0.5, out=buf)
        return buf
    if k == "out_mm":
        buf = torch.zeros(N, N, dtype=a.dtype)
        torch.mm(_m(a), _m(b).to(a.dtype), out=buf)
        return buf.mul_(0.125)
    if k == "matmul":
        return (_m(a) @ _m(b).to(a.dtype)) * 0.125
    if k == "linear":
        return F.linear(_m(a), _m(b).to(a.dtype)) * 0.125
    if k == "softmax":
        return torch.softmax(_m(a).float(), -1).to(a.dtype) if p % 2 else torch.softmax(_m(a), 0, dtype=torch.float32)
    if k == "tanh":
        return torch.tanh(a)
    if k == "binary":
        return _m(a) * _m(b) if p % 2 else _m(a) + _m(b)  # type promotion across dtypes
    if k == "all_gather":
        g = group.all_gather_rows(_wire(a))  # [C * 8, 8]
        return g[:N] - g[-N:]
    if k == "reduce_scatter":
        return group.reduce_scatter_rows(torch.cat([_wire(a)] * group.size) * 0.5)
    if k == "all_reduce":
        c = _wire(a).clone()
        group.all_reduce_(c)
        return c
    raise ValueError(f"unknown instruction kind {k!r}")


def make_program(seed: int, length: int = 20, collectives: bool = False) -> Program:
    rng = np.random.default_rng(seed)
    n_in = int(rng.integers(2, 4))
    dtypes = tuple(FLOATS[int(i)] for i in rng.integers(0, 3, n_in))
    kinds = KINDS + (COLLECTIVES if collectives else ())
    instrs, n_regs = [], n_in
    for _ in range(length):
        k = kinds[int(rng.integers(0, len(kinds)))]
        a, b = int(rng.integers(0, n_regs)), int(rng.integers(0, n_regs))
        instrs.append(Instr(k, a, b, int(rng.integers(0, 2)), int(rng.integers(0, 6))))
        if k not in ("inplace_view", "expand_write", "index_copy_", "scatter_", "copy_"):
            n_regs += 1
    return Program(seed, dtypes, 2, tuple(instrs))


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def check(program: Program, backend, group=None, inference: bool = True) -> str | None:
    """Record, refill inputs, replay; None when every register equals the eager
    run bitwise, else a description of the first that differs."""
    mode = torch.inference_mode if inference else torch.no_grad
    with mode():
        floats, index = program.inputs(program.seed)
        seg = backend.new_segment()
        seg.begin()
        try:
            regs = program.run(floats, index, group)
        finally:
            seg.end()
        fresh_f, fresh_i = program.inputs(program.seed + 10_000)
        for t, v in zip(floats, fresh_f):
            t.copy_(v)
        for t, v in zip(index, fresh_i):
            t.copy_(v)
        seg.replay()
        want = program.run([v.clone() if v.is_contiguous() else v.t().clone().t() for v in fresh_f],
                           [v.clone() for v in fresh_i], group)
    for i, (got, ref) in enumerate(zip(regs, want)):
        if got.dtype != ref.dtype or got.shape != ref.shape or _bits(got) != _bits(ref):
            diff = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("nan")
            return f"program {program.seed}: register {i} ({got.dtype}) differs after replay, max |diff| {diff:.3g}"
    return None
