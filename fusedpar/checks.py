"""Mistakes no rank sees alone, named at a call's first time: one small collective, once.

One rank given a shorter sequence, its activations or its model in another dtype, a
pipeline stage given another batch: each rank alone sees valid input, and the next
collective fails with a transport error ("Received data size doesn't match") or leaves
the other ranks waiting. So fusedpar's layers (`ColumnParallelLinear`,
`RowParallelLinear`, `ParallelSwiGLU`, `ParallelAttention`, `MoE`), `Pipeline.step` and
`parallelize`'s batch check describe what their ranks must agree on in a few int64s
(sizes, dtype codes) and gather them over their groups at their first call: a mismatch
is the same ValueError on every rank, naming the ranks that differ and their values.

| ``FUSEDPAR_CHECKS`` | the checks run                                                   |
| ------------------- | ---------------------------------------------------------------- |
| ``first`` (default) | at the first call of each layer (pipeline, converted model);     |
|                     | after it, a layer's forward reads one attribute: no collective,  |
|                     | no host sync                                                     |
| ``all``             | at every call: a collective and a host sync each, for hunting a  |
|                     | mismatch that appears after the first step                       |

The variable is read at call time, never at import (a layer that has passed its checks
reads it no more); `every_call()` asks for ``all`` inside a block. No check runs while
``torch.compile`` traces (they run at eager calls), inside activation checkpointing's
recompute (its forward was checked), on meta or fake tensors, or on a group of one rank.

A layer's groups are gathered one after the other (each rank passes on what it has
gathered so far), so every rank of their union (tp x cp x ulysses for attention) ends
with the same table and the same verdict, and none is left waiting in a collective that
a rank which raised never joins. What a rank can refuse alone, and would refuse on every
rank given equal input (a wrong feature size, say), is refused after the gather as
before, the same on every rank.
"""

import contextlib
import functools
import os
from collections import Counter
from contextvars import ContextVar

import torch
import torch.distributed as dist

from fusedpar import comm
from fusedpar.recompute import is_recomputing
from fusedpar.storage import warn_if_undistributed

MODES = ("first", "all")
_MODE: ContextVar[str | None] = ContextVar("fusedpar_checks", default=None)
_MAX_DIMS = 6  # a shape travels as its rank and this many sizes (the rest folded into the last)


def mode() -> str:
    """``every_call()``'s "all" inside one, else ``FUSEDPAR_CHECKS`` ("first" unset)."""
    name = _MODE.get() or os.environ.get("FUSEDPAR_CHECKS", "first") or "first"
    if name not in MODES:
        raise ValueError(f"FUSEDPAR_CHECKS must be one of {MODES}, got {name!r}")
    return name


@contextlib.contextmanager
def every_call():
    """Inside, the cross-rank checks run at every call (``FUSEDPAR_CHECKS=all``), for
    layers not yet past their checks (a layer that passed them under "first" is done)."""
    token = _MODE.set("all")
    try:
        yield
    finally:
        _MODE.reset(token)


def skipped(*tensors) -> bool:
    """Where no check runs: while torch.compile traces, in activation checkpointing's
    recompute, on meta or fake tensors. (``is_compiling`` first: dynamo folds it.)"""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_recomputing() or any(t.device.type == "meta" or is_fake(t) for t in tensors)


def due(owner, *tensors) -> bool:
    """Whether `owner`'s checks run at this call: not yet passed (every call under
    "all"), and not `skipped`."""
    return not getattr(owner, "_fusedpar_checked", False) and not skipped(*tensors)


def passed(owner) -> None:
    """`owner`'s checks passed: none runs again, unless FUSEDPAR_CHECKS=all."""
    if mode() != "all":
        owner._fusedpar_checked = True


def first_call(module, x: torch.Tensor, groups: dict, fields: dict) -> None:
    """The checks of a fusedpar layer's call while ``module._fusedpar_checked`` is
    False: once per process, the warning of a layer trained without `distribute`; once
    per layer (every call under "all"), `agree` on `fields` over `groups` (attribute
    name -> group). The layer is done when both are settled."""
    if skipped(x):
        return
    settled = warn_if_undistributed(module, *groups.values())
    if not getattr(module, "_fusedpar_agreed", False) or mode() == "all":
        over = [name for name, group in groups.items() if comm.active_group(group) is not None]
        agree(f"{type(module).__name__} (over its {', '.join(over)})", groups.values(), fields,
              x.device)  # fmt: skip
        module._fusedpar_agreed = True
    if settled:
        passed(module)


def alike(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The fields of a layer whose ranks take x of one shape and dtype (a TP or CP
    group's shares of one batch) and hold weights of one dtype."""
    return {"x": x.shape, "x dtype": x.dtype, "weight dtype": weight.dtype}


# --- the collective and the messages ------------------------------------------------------


@functools.cache
def _dtypes() -> tuple:
    """Every torch dtype, in one order on every rank (of one torch): index = code."""
    return tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))


def _encode(value) -> list[int]:
    if isinstance(value, torch.dtype):
        return [_dtypes().index(value)]
    if isinstance(value, (tuple, list, torch.Size)):
        sizes = [int(s) for s in value]
        if len(sizes) > _MAX_DIMS:
            folded = 1
            for s in sizes[_MAX_DIMS - 1 :]:
                folded *= s
            sizes = sizes[: _MAX_DIMS - 1] + [folded]
        return [len(value), *sizes, *[-1] * (_MAX_DIMS - len(sizes))]
    return [int(value)]


def _decode(example, codes: list[int]) -> str:
    if isinstance(example, torch.dtype):
        return str(_dtypes()[codes[0]]).removeprefix("torch.")
    if isinstance(example, (tuple, list, torch.Size)):
        rank, sizes = codes[0], codes[1:]
        shown = sizes[:rank] if rank <= _MAX_DIMS else [*sizes[:-1], "..."]
        return "(" + ", ".join(map(str, shown)) + ("," if rank == 1 else "") + ")"
    return "none" if codes[0] < 0 else str(codes[0])


def gather(groups, values: list[int], device) -> dict[int, tuple]:
    """{global rank: its `values`} over the union of `groups` (those of more than one
    rank; {} when none has): one all-gather per group, each passing on the rows gathered
    so far, so every rank of the union ends with the same table. A host sync (the
    table is read on the host)."""
    pgs, seen = [], set()
    for group in groups:
        pg = comm.active_group(group)
        if pg is not None and id(pg) not in seen:
            seen.add(id(pg))
            pgs.append(pg)
    if not pgs:
        return {}
    table = torch.tensor([[dist.get_rank(), *values]], dtype=torch.int64).to(device)
    for pg in pgs:
        table = comm._gather(table, pg)
    return {row[0]: tuple(row[1:]) for row in table.tolist()}


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def agree(what: str, groups, fields: dict, device) -> None:
    """The same ValueError on every rank of the union of `groups` unless all pass equal
    `fields` (label -> a shape, a dtype or an int), naming the ranks (global) that
    differ from the most common values and both. One small all-gather per group of
    more than one rank; none otherwise."""
    layout, values = [], []
    for label, value in fields.items():
        codes = _encode(value)
        layout.append((label, value, len(values), len(codes)))
        values += codes
    table = gather(groups, values, device)
    if len(set(table.values())) <= 1:
        return
    # the most common values; a tie goes to the lowest rank's
    counts = Counter(table[rank] for rank in sorted(table))
    common = max(counts, key=lambda row: (counts[row], -min(r for r in table if table[r] == row)))

    def shown(row, labels) -> str:
        return ", ".join(f"{label} {_decode(example, list(row[start : start + n]))}"
                         for label, example, start, n in layout if label in labels)  # fmt: skip

    odd: dict[tuple, list[int]] = {}
    for rank in sorted(table):
        if table[rank] != common:
            odd.setdefault(table[rank], []).append(rank)
    parts = []
    for row, ranks in odd.items():
        labels = [label for label, _, start, n in layout
                  if row[start : start + n] != common[start : start + n]]  # fmt: skip
        others = [rank for rank in table if table[rank] == common]
        parts.append(f"{ranks_text(ranks)} {'have' if len(ranks) > 1 else 'has'} "
                     f"{shown(row, labels)} where {ranks_text(others)} "
                     f"{'have' if len(others) > 1 else 'has'} {shown(common, labels)}")  # fmt: skip
    raise ValueError(f"{what}: the ranks disagree: {'; '.join(parts)}. Every rank of a group "
                     "takes its share of one batch, of one size and dtype, with its model in "
                     "one dtype (FUSEDPAR_CHECKS=all checks every call)")  # fmt: skip
