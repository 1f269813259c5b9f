"""Mistakes no rank sees alone, named at a call's first time: one small collective, once.

One rank given a shorter sequence, another dtype, or another batch sees valid input
alone, and the next collective fails with a transport error or hangs. So the layers
(`ColumnParallelLinear`, `RowParallelLinear`, `ParallelSwiGLU`, `ParallelAttention`,
`MoE`), `Pipeline.step` and `parallelize`'s batch check gather a few int64s (sizes,
dtype codes, a local `Verdict`) over their groups at their first call: a mismatch or a
rank's refusal is the same ValueError on every rank, naming the ranks and their values.

| ``FUSEDPAR_CHECKS`` | the checks run                                                  |
| ------------------- | --------------------------------------------------------------- |
| ``first`` (default) | at each layer's first call; after it no collective, no host sync |
| ``all``             | at every call (a collective and a host sync each)               |

Read at call time (`every_call()` asks for ``all`` inside a block). No check runs while
``torch.compile`` traces, in a checkpoint's recompute, on meta or fake tensors, or on a
group of one rank. A layer's groups are gathered one after the other, each rank passing
on what it has, so every rank of their union ends with the same table and verdict and
none is left waiting in a collective a raising rank never joins. docs/testing.md.
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


def first_call(module, x: torch.Tensor, groups: dict, fields: dict, verdict=None) -> None:
    """The checks of a fusedpar layer's call while ``module._fusedpar_checked`` is
    False: once per process, the warning of a layer trained without `distribute`; once
    per layer (every call under "all"), `agree` on `fields` over `groups` (attribute
    name -> group), with the `verdict` of the call's local checks (run before: a refusal
    is raised on every rank of the groups). The layer is done when both are settled."""
    verdict = verdict or Verdict()
    if skipped(x):
        verdict.reraise()
        return
    settled = warn_if_undistributed(module, *groups.values())
    if not getattr(module, "_fusedpar_agreed", False) or mode() == "all":
        over = [name for name, group in groups.items() if comm.active_group(group) is not None]
        agree(
            f"{type(module).__name__} (over its {', '.join(over)})",
            groups.values(),
            fields,
            x.device,
            verdict,
        )
        module._fusedpar_agreed = True
    verdict.reraise()  # (where it was not gathered)
    if settled:
        passed(module)


def alike(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The fields of a layer whose ranks take x of one shape and dtype (a TP or CP
    group's shares of one batch) and hold weights of one dtype."""
    return {"x": x.shape, "x dtype": x.dtype, "weight dtype": weight.dtype}


class Content:
    """A tensor's shape and bits as one of `agree`'s fields (None: none given): ranks
    differ where either does. It travels as its shape and `comm.fingerprint` (3 int64s),
    and shows as its shape and a short hash of the fingerprint."""

    def __init__(self, tensor: torch.Tensor | None):
        self.tensor = tensor


_KINDS = (None, ValueError, TypeError)  # a verdict's kind: its code is the index


class Verdict:
    """What a rank's local checks of a call concluded, to be gathered with what its
    ranks compare (`agree`, `agree_on_mesh`, `settle`), so that one rank's refusal is
    raised on every rank instead of leaving the others waiting in the gather:

        verdict = Verdict()
        taken = verdict.run(read_batch, kwargs)   # None where it raised
        agree(what, groups, fields, device, verdict)   # raises on every rank

    `run` keeps a ValueError or TypeError; anything else propagates, on that rank alone
    (a bug, not a refusal), so a check run here validates its arguments' types first
    (a TypeError where a tensor is expected), before reading their shapes. While
    torch.compile traces, no gather follows (`skipped`): `run` lets the error through."""

    def __init__(self):
        self.error: ValueError | TypeError | None = None

    def run(self, fn, *args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as error:
            self.error = error
            return None

    def codes(self) -> list[int]:
        """[kind, message length in UTF-8 bytes] ([0, 0]: passed), for a gathered row."""
        if self.error is None:
            return [0, 0]
        return [
            _KINDS.index(ValueError if isinstance(self.error, ValueError) else TypeError),
            len(self.message()),
        ]

    def message(self) -> bytes:
        return str(self.error).encode()

    def reraise(self) -> None:
        """Where no gather ran (one rank, a call past its first): this rank's error."""
        if self.error is not None:
            raise self.error


# --- the collective and the messages ------------------------------------------------------


@functools.cache
def _dtypes() -> tuple:
    """Every torch dtype, in one order on every rank (of one torch): index = code."""
    return tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))


def _encode(value) -> list[int]:
    if isinstance(value, Content):
        if not isinstance(value.tensor, torch.Tensor):  # (a refusing rank's: never raise)
            return [-1] * (1 + _MAX_DIMS) + [0, 0, 0]
        return _encode(value.tensor.shape) + comm.fingerprint(value.tensor).tolist()
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
    if isinstance(example, Content):
        if codes[0] < 0:
            return "none"
        digest = 0
        for code in codes[-3:]:  # the fingerprint, shown as 6 hex digits
            digest = (digest * 1000003 + code) % (1 << 24)
        return f"{_decode((), codes[:-3])} #{digest:06x}"
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
        table = comm.plain_all_gather(table, pg)
    return {row[0]: tuple(row[1:]) for row in table.tolist()}


def gather_mesh(mesh, values: list[int]) -> dict[int, tuple]:
    """{global rank: its `values`} over every rank of `mesh` ({} for a mesh of one rank
    or None): one all-gather (`comm.mesh_table`), the same table on every rank."""
    if mesh is None or mesh.size() == 1:
        return {}
    table = comm.mesh_table(torch.tensor(values, dtype=torch.int64), mesh)
    ranks = mesh.mesh.flatten().tolist()
    rows = table.reshape(len(ranks), -1).tolist()
    return {rank: tuple(row) for rank, row in zip(ranks, rows, strict=True)}


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def settle(verdict: Verdict, verdicts: dict[int, tuple], exchange) -> None:
    """The same error on every rank of a gathered table where any rank's local checks
    refused (`verdicts`: {rank: its `Verdict.codes()`}, the same on every rank): the
    refusing ranks' messages travel in one more gather, `exchange` (a row of ints ->
    {rank: row}, over the same ranks), and every rank raises "ranks ...: message" for
    each message (the message alone where every rank refused alike); a ValueError,
    a TypeError where every refusal was one. Nothing where none refused."""
    refused = {rank: kind for rank, (kind, _) in verdicts.items() if kind}
    if not refused:
        return
    width = max(length for _, length in verdicts.values())
    mine = list(verdict.message()) if verdict.error is not None else []
    rows = exchange(mine + [0] * (width - len(mine)))
    by_message: dict[str, list[int]] = {}
    for rank in sorted(refused):
        text = bytes(rows[rank][: verdicts[rank][1]]).decode(errors="replace")
        by_message.setdefault(text, []).append(rank)
    kind = TypeError if set(refused.values()) == {_KINDS.index(TypeError)} else ValueError
    if len(refused) == len(verdicts) and len(by_message) == 1:
        message = next(iter(by_message))  # every rank refused alike: as one process would
    else:
        others = sorted(set(verdicts) - set(refused))
        message = "; ".join(f"{ranks_text(ranks)}: {text}" for text, ranks in by_message.items())
        if others:
            message += (
                f" ({ranks_text(others)} passed {'their' if len(others) > 1 else 'its'} "
                "checks; every rank raises this)"
            )
    raise kind(message) from verdict.error


HINT = (
    "Every rank of a group takes its share of one batch, of one size and dtype, with its "
    "model in one dtype (FUSEDPAR_CHECKS=all checks every call)"
)


def agree(what: str, groups, fields: dict, device, verdict: Verdict | None = None) -> None:
    """The same ValueError on every rank of the union of `groups` unless all pass equal
    `fields` (label -> a shape, a dtype, an int or a `Content`), naming the ranks
    (global) that differ from the most common values and both; before that, a refusal
    of any rank's `verdict` (`settle`). One small all-gather per group of more than one
    rank (none otherwise: then this rank's own refusal is raised)."""
    _agree(what, fields, verdict, lambda values: gather(groups, values, device), None, HINT)


def agree_on_mesh(
    what: str,
    mesh,
    fields: dict,
    verdict: Verdict | None = None,
    *,
    apart: int | None = None,
    hint: str = HINT,
    carried: list[int] = (),
) -> dict[int, tuple]:
    """`agree` over every rank of `mesh` (one all-gather, `gather_mesh`), where the ranks
    at different coordinates of mesh axis `apart` (dp: other batches) may differ. The
    ints `carried` travel uncompared: returns {rank: its carried} ({} where nothing was
    gathered)."""
    partitions = None
    if apart is not None and mesh is not None:
        partitions = [r.flatten().tolist() for r in mesh.mesh.movedim(apart, 0)]
    exchange = functools.partial(gather_mesh, mesh)
    return _agree(what, fields, verdict, exchange, partitions, hint, list(carried))


def _agree(what, fields, verdict, exchange, partitions, hint, carried=()) -> dict[int, tuple]:
    """`agree`'s body: `exchange` (a row of ints -> {rank: row}) gathers the fields'
    codes, the verdict's and `carried`; each of `partitions` (lists of ranks; None: all)
    must agree. Returns {rank: its carried}."""
    verdict = verdict or Verdict()
    layout, values = [], []
    for label, value in fields.items():
        codes = _encode(value)
        layout.append((label, value, len(values), len(codes)))
        values += codes
    table = exchange([*values, *verdict.codes(), *carried])
    if not table:
        verdict.reraise()
        return {}
    n = len(values)
    settle(verdict, {rank: row[n : n + 2] for rank, row in table.items()}, exchange)
    compared = {rank: row[:n] for rank, row in table.items()}
    for ranks in partitions or [sorted(table)]:
        detail = _disagreement({rank: compared[rank] for rank in ranks}, layout)
        if detail:
            raise ValueError(f"{what}: the ranks disagree: {detail}. {hint}")
    return {rank: row[n + 2 :] for rank, row in table.items()}


def _disagreement(table: dict[int, tuple], layout: list) -> str | None:
    """None where every row of `table` is equal; else which ranks differ from the most
    common row (a tie: the lowest rank's), in which fields, and both values."""
    if len(set(table.values())) <= 1:
        return None
    counts = Counter(table[rank] for rank in sorted(table))
    common = max(counts, key=lambda row: (counts[row], -min(r for r in table if table[r] == row)))

    def shown(row, labels) -> str:
        return ", ".join(
            f"{label} {_decode(example, list(row[start : start + n]))}"
            for label, example, start, n in layout
            if label in labels
        )

    odd: dict[tuple, list[int]] = {}
    for rank in sorted(table):
        if table[rank] != common:
            odd.setdefault(table[rank], []).append(rank)
    parts = []
    others = [rank for rank in sorted(table) if table[rank] == common]
    for row, ranks in odd.items():
        labels = [
            label
            for label, _, start, n in layout
            if row[start : start + n] != common[start : start + n]
        ]
        verb, verb_others = ("have" if len(r) > 1 else "has" for r in (ranks, others))
        parts.append(
            f"{ranks_text(ranks)} {verb} {shown(row, labels)} where {ranks_text(others)} "
            f"{verb_others} {shown(common, labels)}"
        )
    return "; ".join(parts)
