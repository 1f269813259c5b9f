"""Process groups, differentiable collectives, async collectives and the ring.

Every function takes ``group``: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or ``None``
(no parallelism: each collective is the identity, no ``torch.distributed`` needed).
Collectives work on dim 0 and validate their inputs before communicating, so bad input
raises the same ``ValueError`` on every rank. Differentiable collectives (W ranks):

| function              | forward                         | backward of ``g``                  |
| --------------------- | ------------------------------- | ---------------------------------- |
| `all_gather`          | ``cat_r x_r``  (n -> W*n)       | ``reduce_scatter(g)``              |
| `reduce_scatter`      | ``(sum_r x_r)[chunk r]``        | ``all_gather(g)``                  |
| `all_reduce`          | ``sum_r x_r``                   | ``all_reduce(g)``                  |
| `copy_to_region`      | ``x``                           | ``all_reduce(g)``                  |
| `reduce_from_region`  | ``sum_r x_r``                   | ``g``                              |
| `gather_from_region`  | ``cat_r x_r`` along `dim`       | ``g``'s chunk r along `dim`        |
| `all_to_all`          | rows ``in_splits[s]`` to rank s | ``all_to_all`` with splits swapped |

`all_gather` and `all_reduce` give the gradient of a sum when every rank goes on with
its own loss; the ``*_region`` functions are Megatron's mappings for a region whose
downstream is replicated (each rank computes the same loss, counted once).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fusedpar.kernels.impl import cpu_path
from fusedpar.kernels.tuning import Agreement

Group = dist.ProcessGroup | DeviceMesh | None

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); torch 2.11,
# on our GPU machines, has only the old ones. Same arguments either way.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- groups -------------------------------------------------------------------------


def resolve_group(group: Group) -> dist.ProcessGroup | None:
    """The ``ProcessGroup`` behind `group` (``None`` stays ``None``: no parallelism)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh group must be 1-D, got a {group.ndim}-D mesh with dims "
                f"{group.mesh_dim_names}: pass mesh[name] for the axis you mean"
            )
        return group.get_group()
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group)}")


def active_group(group: Group) -> dist.ProcessGroup | None:
    """The ``ProcessGroup`` behind `group` if it has more than one rank, else ``None``: a
    group of one communicates nothing, so every collective over it is the identity and
    runs none (as with ``group=None``)."""
    pg = resolve_group(group)
    return pg if pg is not None and dist.get_world_size(pg) > 1 else None


def group_size(group: Group) -> int:
    pg = resolve_group(group)
    return 1 if pg is None else dist.get_world_size(pg)


def group_rank(group: Group) -> int:
    pg = resolve_group(group)
    return 0 if pg is None else dist.get_rank(pg)


@torch.compiler.assume_constant_result
def group_name(pg: dist.ProcessGroup | None) -> str:
    """The name a group crosses a custom-op boundary by (`group_by_name` resolves it;
    "" for None). A constant to torch.compile: the group is fixed for a traced call."""
    return "" if pg is None else pg.group_name


def group_by_name(name: str) -> dist.ProcessGroup | None:
    """The process group registered under `name` (from `group_name`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name) if name else None


def tuning_agreement(group: Group, device: torch.device) -> Agreement | None:
    """What makes the ranks of `group` pick the same kernel tiles: each candidate's time
    summed over the ranks (one all-reduce per tuned key, on `device`), the lowest sum
    winning. None for no group or a group of one."""
    pg = resolve_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return None

    def sum_times(times: list[float]) -> list[float]:
        summed = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=pg)
        return summed.tolist()  # a host sync, once per tuned key

    name = getattr(pg, "group_name", None) or str(dist.get_process_group_ranks(pg))
    return Agreement(f"group {name}", sum_times)


@cpu_path  # its host work runs on CPUs only: no host sync on a GPU run
def check_same_across_ranks(group: Group, values: Sequence[int], what: str, device) -> None:
    """Raise the same ValueError on every rank of `group` unless all pass equal
    `values` (shapes, say), for tensors on `device`. One tiny all-gather on CPU (gloo),
    where a mismatch would otherwise crash the collective that follows; skipped on
    GPUs, where it would cost a host sync per call (ranks must pass the same shapes
    there, as for any collective). Not cached: a rank that alone met new values would
    wait in the all-gather the others skip."""
    pg = resolve_group(group)
    if pg is None or dist.get_world_size(pg) == 1 or torch.device(device).type != "cpu":
        return
    mine = torch.tensor(list(values), dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine, group=pg)
    seen = {tuple(t.tolist()) for t in everyone}
    if len(seen) > 1:
        raise ValueError(f"{what}: ranks disagree: {sorted(seen)}")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """(3,) int64 on t's device, equal for tensors of equal shape and bits: two weighted
    sums of t's bits (integer sums wrap, and wrap the same in any order: no rounding
    to differ between ranks) and its element count."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = flat.view(ints[flat.element_size()])
    sums = torch.zeros(3, dtype=torch.int64, device=flat.device)
    sums[2] = flat.numel()
    step = 1 << 22  # int64 temporaries of 32 MiB, whatever the tensor's size
    for start in range(0, flat.numel(), step):
        bits = flat[start : start + step].to(torch.int64)
        weights = torch.arange(start, start + len(bits), device=flat.device) % 65521 + 1
        sums[0] += bits.sum()
        sums[1] += (bits * weights).sum()
    return sums


def mesh_table(values: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's `values` (any shape V) at its coordinate of `mesh`: (*mesh.shape,
    *V), the same on every rank. One all-gather over the mesh's ranks (the world's, when the
    mesh spans it)."""
    shape, values = values.shape, values.to(mesh.device_type).reshape(-1)
    ranks = mesh.mesh.flatten()
    if mesh.size() == dist.get_world_size():
        pg = dist.group.WORLD
    else:
        pg = (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()
    gathered = values.new_empty(len(ranks) * len(values))
    _all_gather_tensor(gathered, values, group=pg)
    gathered = gathered.view(len(ranks), len(values))
    if pg is dist.group.WORLD:
        gathered = gathered[ranks]  # global rank order -> the mesh's order
    return gathered.cpu().view(*mesh.shape, *shape)


def check_dim0_divisible(x: torch.Tensor, size: int, what: str) -> None:
    if x.dim() == 0:
        raise ValueError(f"{what} needs a tensor with a dim 0, got a scalar")
    if x.shape[0] % size:
        raise ValueError(
            f"{what}: dim 0 of size {x.shape[0]} (shape {tuple(x.shape)}) is not divisible "
            f"by the group size {size}"
        )


def _check_splits(name: str, splits: Sequence[int], size: int, total: int | None) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != size:
        raise ValueError(f"{name} must have one entry per rank ({size}), got {len(splits)}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} must be non-negative, got {splits}")
    if total is not None and sum(splits) != total:
        raise ValueError(f"{name} {splits} sum to {sum(splits)}, but dim 0 has {total} rows")
    return splits


# --- plain collectives (no autograd) ---------------------------------------------------


def plain_all_gather(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """``cat_r x_r`` over `pg` (a ProcessGroup), dim 0; no autograd, no checks."""
    out = x.new_empty((dist.get_world_size(pg) * x.shape[0], *x.shape[1:]))
    _all_gather_tensor(out, x.contiguous(), group=pg)
    return out


def _scatter_sum(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // dist.get_world_size(pg), *x.shape[1:]))
    _reduce_scatter_tensor(out, x.contiguous(), group=pg)
    return out


def _sum(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=pg)
    return out


def plain_all_to_all(x, pg, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Rows `input_splits[s]` of `x` to rank s of `pg`, `output_splits[s]` rows from it;
    no autograd, no checks."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=pg)
    return out


# --- differentiable collectives --------------------------------------------------------


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return plain_all_gather(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sum(grad, ctx.pg), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _scatter_sum(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return plain_all_gather(grad, ctx.pg), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _sum(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.pg), None


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.pg), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        return _sum(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        gathered = plain_all_gather(x.movedim(dim, 0), pg)
        return gathered.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        chunks = grad.chunk(dist.get_world_size(ctx.pg), dim=ctx.dim)
        return chunks[dist.get_rank(ctx.pg)].contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, output_splits, input_splits):
        ctx.pg, ctx.output_splits, ctx.input_splits = pg, output_splits, input_splits
        return plain_all_to_all(x, pg, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return plain_all_to_all(grad, ctx.pg, ctx.input_splits, ctx.output_splits), None, None, None


def all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0: (n, ...) -> (W*n, ...). Same n on all ranks."""
    pg = active_group(group)
    if x.dim() == 0:
        raise ValueError("all_gather needs a tensor with a dim 0, got a scalar")
    return x if pg is None else _AllGather.apply(x, pg)


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `x` over ranks and keep this rank's chunk of dim 0: (W*n, ...) -> (n, ...)."""
    pg = active_group(group)
    check_dim0_divisible(x, group_size(pg), "reduce_scatter")
    return x if pg is None else _ReduceScatter.apply(x, pg)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `x` over ranks (out of place); the gradient is summed over ranks too."""
    pg = active_group(group)
    return x if pg is None else _AllReduce.apply(x, pg)


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward: enter a tensor-parallel region."""
    pg = active_group(group)
    return x if pg is None else _CopyToRegion.apply(x, pg)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward: leave a tensor-parallel region."""
    pg = active_group(group)
    return x if pg is None else _ReduceFromRegion.apply(x, pg)


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (same shape on all ranks); the backward
    keeps this rank's chunk of the gradient: leave a region whose output is replicated
    (Megatron's ``gather_output`` of a column-parallel layer)."""
    pg = active_group(group)
    if x.dim() == 0:
        raise ValueError("gather_from_region needs a tensor with at least one dim")
    return x if pg is None else _GatherFromRegion.apply(x, pg, dim % x.dim())


class _SplitToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, dim):
        ctx.pg, ctx.dim = pg, dim
        return x.chunk(dist.get_world_size(pg), dim=dim)[dist.get_rank(pg)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        gathered = plain_all_gather(grad.movedim(ctx.dim, 0).contiguous(), ctx.pg)
        return gathered.movedim(0, ctx.dim).contiguous(), None, None


def split_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (every rank holds `x` whole); the backward
    gathers every rank's chunk of the gradient, so each gets the whole one (the dual of
    `gather_from_region`)."""
    pg = active_group(group)
    if pg is None:
        return x
    if x.shape[dim] % dist.get_world_size(pg):
        raise ValueError(
            f"split_to_region: dim {dim} of size {x.shape[dim]} does not divide by the "
            f"group's {dist.get_world_size(pg)} ranks"
        )
    return _SplitToRegion.apply(x, pg, dim % x.dim())


def all_to_all(
    x: torch.Tensor,
    group: Group,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send rows ``input_split_sizes[s]`` of `x` (in order) to rank s; receive
    ``output_split_sizes[s]`` rows from rank s. ``None`` splits dim 0 evenly.

    Zero-size splits are fine: a rank with nothing to send still calls this, so every
    rank takes part in the collective and none waits forever.
    """
    pg = active_group(group)
    size = group_size(pg)
    if x.dim() == 0:
        raise ValueError("all_to_all needs a tensor with a dim 0, got a scalar")
    if input_split_sizes is None:
        check_dim0_divisible(x, size, "all_to_all with even input splits")
        input_split_sizes = [x.shape[0] // size] * size
    input_splits = _check_splits("input_split_sizes", input_split_sizes, size, x.shape[0])
    if output_split_sizes is None:
        output_split_sizes = [x.shape[0] // size] * size if x.shape[0] % size == 0 else None
        if output_split_sizes is None:
            raise ValueError(
                f"all_to_all: output_split_sizes must be given when dim 0 ({x.shape[0]}) is "
                f"not divisible by the group size {size}"
            )
    output_splits = _check_splits("output_split_sizes", output_split_sizes, size, None)
    if pg is None:
        return x
    return _AllToAll.apply(x, pg, output_splits, input_splits)


# --- async collectives ---------------------------------------------------------------


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # One communication stream per GPU, made on first use (never at import).
    return torch.cuda.Stream(device=device)


class Pending:
    """A collective in flight. `wait()` returns its result, once.

    On CPU (gloo) `wait()` blocks until the work is done. On a GPU the collective was
    issued from a side stream that first waited for the caller's stream (so it reads
    finished inputs); `wait()` makes the caller's current stream wait for it, without
    blocking the host.
    """

    def __init__(self, works, result, stream: torch.cuda.Stream | None = None):
        self._works, self._result, self._stream = list(works), result, stream
        self._done = False

    def wait(self):
        if self._done:
            raise RuntimeError("wait() was already called on this Pending collective")
        self._done = True
        for work in self._works:
            work.wait()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return self._result


def _issue(device: torch.device, issue) -> tuple[list, torch.cuda.Stream | None]:
    """Run ``issue()`` (which posts async work and returns its handles) on the side stream."""
    if device.type != "cuda":
        return issue(), None
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        return issue(), stream


def all_gather_async(x: torch.Tensor, group: Group, *, out: torch.Tensor | None = None) -> Pending:
    """Start ``all_gather(x)`` (no autograd) into `out` (W*n, ...); ``.wait()`` returns it."""
    pg = active_group(group)
    size = group_size(pg)
    shape = (size * x.shape[0], *x.shape[1:])
    if out is None:
        out = x.new_empty(shape)
    elif out.shape != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape}, got {tuple(out.shape)}")
    if pg is None:
        return Pending([], out.copy_(x))
    x = x.contiguous()
    works, stream = _issue(x.device, lambda: [_all_gather_tensor(out, x, group=pg, async_op=True)])
    return Pending(works, out, stream)


def all_to_all_async(x: torch.Tensor, group: Group) -> Pending:
    """Start an even ``all_to_all(x)`` (no autograd): chunk s of dim 0 goes to rank s,
    and ``.wait()`` returns the chunks received, rank r's as chunk r."""
    pg = active_group(group)
    check_dim0_divisible(x, group_size(pg), "all_to_all_async")
    if pg is None:
        return Pending([], x)
    x = x.contiguous()
    out = torch.empty_like(x)
    works, stream = _issue(
        x.device, lambda: [dist.all_to_all_single(out, x, group=pg, async_op=True)]
    )
    return Pending(works, out, stream)


def reduce_scatter_async(x: torch.Tensor, group: Group) -> Pending:
    """Start ``reduce_scatter(x)`` (no autograd); ``.wait()`` returns this rank's sum."""
    pg = active_group(group)
    size = group_size(pg)
    check_dim0_divisible(x, size, "reduce_scatter_async")
    if pg is None:
        return Pending([], x)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    works, stream = _issue(
        x.device, lambda: [_reduce_scatter_tensor(out, x, group=pg, async_op=True)]
    )
    return Pending(works, out, stream)


def all_reduce_async(x: torch.Tensor, group: Group) -> Pending:
    """Start an out-of-place ``all_reduce(x)`` (no autograd); ``.wait()`` returns the sum."""
    pg = active_group(group)
    if pg is None:
        return Pending([], x)
    out = x.clone(memory_format=torch.contiguous_format)
    works, stream = _issue(x.device, lambda: [dist.all_reduce(out, group=pg, async_op=True)])
    return Pending(works, out, stream)


# --- ring ----------------------------------------------------------------------------


class Ring:
    """Point-to-point ring: send to rank ``r + 1``, receive from rank ``r - 1``.

    At most one exchange is in flight; ``send_recv`` posts it and returns the tensors that
    `wait` will have filled, so the overlap is visible in the loop::

        ring = Ring(group)
        for step in range(ring.size):
            if step + 1 < ring.size:
                incoming = ring.send_recv(kv)   # posted now ...
            compute(kv)                         # ... overlaps this
            if step + 1 < ring.size:
                kv = ring.wait()                # == incoming, now filled

    Receive buffers are double-buffered: two per (shape, dtype, device), used in turn, so
    a loop that sends what it last received allocates nothing after the first step. A
    received tensor stays valid until the second ``send_recv`` after the one that
    returned it. Misuse (two ``send_recv`` without ``wait``, ``wait`` with nothing in
    flight, non-contiguous tensors) raises.
    """

    def __init__(self, group: Group, *, tag: int = 0):
        self._pg = resolve_group(group)
        self.tag = (
            tag  # rings with exchanges in flight at once between the same ranks differ in tag
        )
        self.size = group_size(self._pg)
        self.rank = group_rank(self._pg)
        if self._pg is not None:
            self.next_rank = dist.get_global_rank(self._pg, (self.rank + 1) % self.size)
            self.prev_rank = dist.get_global_rank(self._pg, (self.rank - 1) % self.size)
        self._pending: tuple[Pending, bool] | None = None
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def _free_buffer(self, slot: int, tensor: torch.Tensor) -> torch.Tensor:
        # Each position in the sent sequence has its own pair, used in turn: the buffer
        # handed out last time may be what is being sent now, so take the other one.
        key = (slot, tuple(tensor.shape), tensor.dtype, tensor.device)
        pair = self._buffers.setdefault(key, [])
        if len(pair) < 2:
            pair.insert(0, torch.empty_like(tensor, memory_format=torch.contiguous_format))
        pair.reverse()
        return pair[-1]

    def send_recv(self, tensors, out=None):
        """Post: send `tensors` to the next rank, receive the previous rank's into `out`.

        `tensors` is a tensor or a sequence of them (e.g. K and V, or dK and dV in fp32);
        `out`, if given, has the same structure. Returns the receive tensors.
        """
        if self._pending is not None:
            raise RuntimeError("Ring.send_recv called again before wait(): one exchange at a time")
        single = isinstance(tensors, torch.Tensor)
        sends = [tensors] if single else list(tensors)
        for i, t in enumerate(sends):
            if not t.is_contiguous():
                raise ValueError(
                    f"Ring.send_recv: tensor {i} of shape {tuple(t.shape)} is not contiguous"
                )
        if out is None:
            recvs = [self._free_buffer(i, t) for i, t in enumerate(sends)]
        else:
            recvs = [out] if isinstance(out, torch.Tensor) else list(out)
            if [(r.shape, r.dtype) for r in recvs] != [(t.shape, t.dtype) for t in sends]:
                raise ValueError(
                    "Ring.send_recv: out must match the sent tensors in shape and dtype"
                )
        if self.size == 1:
            for r, t in zip(recvs, sends, strict=True):
                r.copy_(t)
            pending = Pending([], recvs)
        else:
            ops = [dist.P2POp(dist.isend, t, self.next_rank, self._pg, self.tag) for t in sends]
            ops += [dist.P2POp(dist.irecv, r, self.prev_rank, self._pg, self.tag) for r in recvs]
            works, stream = _issue(sends[0].device, lambda: dist.batch_isend_irecv(ops))
            pending = Pending(works, recvs, stream)
        self._pending = (pending, single)
        return recvs[0] if single else recvs

    def wait(self):
        """Wait for the exchange posted by `send_recv` and return what it received."""
        if self._pending is None:
            raise RuntimeError("Ring.wait called with no send_recv in flight")
        (pending, single), self._pending = self._pending, None
        recvs = pending.wait()
        return recvs[0] if single else recvs
