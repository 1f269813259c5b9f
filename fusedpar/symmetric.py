"""The fused schedule's transport (``overlap="fused"``): symmetric-memory buffers, copies
by the copy engine, and a flag written after each.

| side           | before the GEMM                 | during it (side stream, high priority)   |
| -------------- | ------------------------------- | ---------------------------------------- |
| all-gather     | x into this rank's symmetric    | rank + 1, rank + 2, ...: pull the peer's |
|                | shard; own rows into place,     | shard into its rows of the gathered      |
|                | ``flags[rank] = 1``; barrier    | buffer, then ``flags[src] = 1``          |
| reduce-scatter | flags and counts zeroed;        | per destination d (rank + 1 first): wait |
|                | barrier                         | for its tiles' count, copy them into d's |
|                |                                 | ``received[rank]``, ``d.flags[rank] = 1``|

The persistent GEMM (`fusedpar.kernels.matmul_fused`) waits on the flags or raises the
counts; a last kernel sums the received partials. Flag writes are stream memory ops, so
a step captures into a CUDA graph; the all-gather ends with a barrier. The
reduce-scatter's GEMM leaves one SM free for the one-program count waits. A wait past
``FUSEDPAR_WAIT_S`` (default 30 s) stops the kernel, and `Watchdog` ends the process
with its record. Buffers are made once per (group, shape, dtype) (`transport`).
"""

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from fusedpar.kernels import matmul_fused
from fusedpar.kernels.common import next_power_of_2

DEFAULT_WAIT_S = 30.0


def wait_seconds() -> float:
    """``FUSEDPAR_WAIT_S`` (read at the call), else 30 s: how long a fused kernel waits
    for a chunk before it stops."""
    text = os.environ.get("FUSEDPAR_WAIT_S", "")
    try:
        value = float(text) if text else DEFAULT_WAIT_S
    except ValueError:
        raise ValueError(f"FUSEDPAR_WAIT_S must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"FUSEDPAR_WAIT_S must be positive, got {text!r}")
    return value


def unavailable(pg: dist.ProcessGroup | None) -> str | None:
    """Why the fused schedule cannot run over `pg` (None: it can). The same answer on
    every rank (it reads the backend and this torch, nothing rank-local)."""
    backend = None if pg is None else dist.get_backend(pg)
    if backend != "nccl":
        return f"it needs CUDA tensors on an NCCL group, this group is {backend}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no symmetric memory"
    return None


def signal(flags: torch.Tensor, index: int) -> None:
    """``flags[index] = 1`` (int32) on the current stream, after its earlier work: a
    stream write (no kernel), or a one-word memset while a graph is captured."""
    from torch._C._distributed_c10d import _SymmetricMemory

    words = flags.view(torch.uint32)  # (the stream ops take flat uint32 tensors only)
    if torch.cuda.is_current_stream_capturing():
        _SymmetricMemory.memset32(words, offset=index, val=1, count=1)
    else:
        _SymmetricMemory.stream_write_value32(words, index, 1)


class Watchdog:
    """Reports a fused kernel's stopped wait: the kernels write (op, rank, chunk) into
    `status` (pinned host memory) before they trap. A thread reads it every 0.1 s, and at
    exit it is read once more; a record ends the process with the message (the CUDA
    context is lost after the trap, so nothing could go on)."""

    _instances: dict[torch.device, "Watchdog"] = {}

    def __init__(self):
        self.status = torch.zeros(3, dtype=torch.int32).pin_memory()
        threading.Thread(target=self._watch, name="fusedpar-watchdog", daemon=True).start()
        atexit.register(self._report)

    @classmethod
    def of(cls, device: torch.device) -> "Watchdog":
        if device not in cls._instances:
            cls._instances[device] = cls()
        return cls._instances[device]

    def message(self) -> str | None:
        op, rank, chunk = (int(v) for v in self.status)
        if op == 0:
            return None
        name = matmul_fused.OPS[op - 1]
        return (
            f"fusedpar: {name} (overlap='fused') on rank {rank} waited more than "
            f"FUSEDPAR_WAIT_S = {wait_seconds():g} s for chunk {chunk} (the rows of rank "
            f"{chunk}); the kernel stopped. A peer did not deliver: it failed, or it "
            "called a different op"
        )

    def _watch(self):
        while True:
            time.sleep(0.1)
            if self._report():
                os._exit(1)

    def _report(self) -> bool:
        text = self.message()
        if text is not None:
            print(text, file=sys.stderr, flush=True)
        return text is not None


_WARNED: set[str] = set()


def say_once(what: str) -> None:
    """A schedule's choice that the caller did not see (part of a fused call run unfused,
    a candidate left out of "auto"), said once per message."""
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(f"fusedpar: {what}", stacklevel=3)


class _Transport:
    def __init__(self, pg: dist.ProcessGroup, device: torch.device):
        self.pg, self.device = pg, device
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.status = Watchdog.of(device).status


class Gather(_Transport):
    """The all-gather side for x of up to `rows` rows, K columns, one dtype."""

    def __init__(self, pg, rows: int, K: int, dtype: torch.dtype, device):
        super().__init__(pg, device)
        from torch.distributed import _symmetric_memory as symm_mem

        shape = (rows, K)
        self.shard = symm_mem.empty(shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.shard, pg.group_name)  # collective, once
        self.peers = [self.handle.get_buffer(r, shape, dtype) for r in range(self.world)]
        self.flags = torch.zeros(self.world, dtype=torch.int32, device=device)

    def start(self, x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """`gathered` (W*m, K), filling: own rows now, the peers' from the side stream in
        rank-rotated order, each chunk's flag set after it (`flags`). Under `poisoned`,
        NaN first: a chunk read before it lands shows."""
        m, rank, world = x.shape[0], self.rank, self.world
        current = torch.cuda.current_stream(self.device)
        shard = self.shard[:m]
        shard.copy_(x)
        self.flags.zero_()
        if POISON:
            gathered.fill_(float("nan"))
        gathered[rank * m : (rank + 1) * m].copy_(x)
        signal(self.flags, rank)
        self.handle.barrier(channel=0)  # every rank's shard is written
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for step in range(1, world):
                src = (rank + step) % world
                gathered[src * m : (src + 1) * m].copy_(self.peers[src][:m])  # copy engine
                signal(self.flags, src)
        return gathered

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.handle.barrier(channel=0)  # no peer reads this rank's shard any more


class Scatter(_Transport):
    """The reduce-scatter side for partials of up to `rows` rows a rank, N columns, in
    `dtype` (the reduce dtype)."""

    def __init__(self, pg, rows: int, N: int, dtype: torch.dtype, device):
        super().__init__(pg, device)
        from torch.distributed import _symmetric_memory as symm_mem

        world = self.world
        self.received = symm_mem.empty((world, rows, N), dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.received, pg.group_name)
        self.peer_received = [
            self.handle.get_buffer(r, (world, rows, N), dtype) for r in range(world)
        ]
        self.flags = symm_mem.empty((world,), dtype=torch.int32, device=device)
        self.flag_handle = symm_mem.rendezvous(self.flags, pg.group_name)
        self.peer_flags = [
            self.flag_handle.get_buffer(r, (world,), torch.int32) for r in range(world)
        ]
        self.counts = torch.zeros(world, dtype=torch.int32, device=device)
        self.rows, self.dtype = rows, dtype

    def run(self, pairs, out_dtype: torch.dtype, bias, tiles: int, gemm) -> torch.Tensor:
        """This rank's (m, N) rows of ``sum_ranks sum_i A_i @ B_i`` + bias: ``gemm(P,
        counts)`` writes the partials P (W*m, N) counting `tiles` per chunk, each chunk
        leaves as soon as counted."""
        m, rank, world = pairs[0][0].shape[0] // self.world, self.rank, self.world
        received = self.received[:, :m]
        current = torch.cuda.current_stream(self.device)
        wait_s = wait_seconds()
        self.flags.zero_()
        self.counts.zero_()
        if POISON:
            received.fill_(float("nan"))
        self.handle.barrier(channel=0)  # every rank reset its flags: peers may write them
        partials = torch.empty(
            (world * m, self.received.shape[2]), dtype=self.dtype, device=self.device
        )
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for step in range(1, world):
                dest = (rank + step) % world
                matmul_fused.wait_count(
                    self.counts, dest, tiles, rank, status=self.status, wait_s=wait_s
                )
                self.peer_received[dest][rank, :m].copy_(partials[dest * m : (dest + 1) * m])
                signal(self.peer_flags[dest], rank)
        gemm(partials, self.counts)
        # The sends first: the sum's CTAs spin on the peers' flags, and enough of them
        # could hold every SM while this rank's count waits (one-program kernels on the
        # side stream) still need one, so no rank would send.
        current.wait_stream(self.stream)
        return matmul_fused.sum_partials(
            partials[rank * m : (rank + 1) * m],
            received,
            self.flags,
            rank,
            out_dtype,
            bias,
            status=self.status,
            wait_s=wait_s,
        )


_TRANSPORTS: dict[tuple, _Transport] = {}
POISON = False  # NaN in the landing buffers before each call (`poisoned`)


@contextlib.contextmanager
def poisoned():
    """Inside, the transports fill their landing buffers with NaN before each call: a
    chunk read before it landed shows in the result ("auto"'s check of its candidates)."""
    global POISON
    saved, POISON = POISON, True
    try:
        yield
    finally:
        POISON = saved


def transport(kind: type, pg: dist.ProcessGroup, rows: int, *key) -> _Transport:
    """The `Gather` or `Scatter` for `pg` holding `rows` rows a rank (the next power of
    two: growing lengths reuse it; a call takes views) and this `key` (widths, dtype,
    device). Made on first use: a collective every rank reaches with the same shapes, as
    the op's call is, which first checks that the group's ranks share one host (symmetric
    memory maps peers' memory: a ValueError on every rank otherwise)."""
    capacity = max(1, next_power_of_2(rows))
    full = (kind, pg.group_name, capacity, *key)
    if full not in _TRANSPORTS:
        _check_one_host(pg)
        _TRANSPORTS[full] = kind(pg, capacity, *key)
    return _TRANSPORTS[full]


def _check_one_host(pg: dist.ProcessGroup) -> None:
    hosts = [None] * dist.get_world_size(pg)
    dist.all_gather_object(hosts, socket.gethostname(), group=pg)
    if len(set(hosts)) > 1:
        raise ValueError(
            f"overlap='fused' maps peers' GPU memory, so its group must be on one "
            f"host; this one spans {sorted(set(hosts))}: use 'serial' or 'ring'"
        )
