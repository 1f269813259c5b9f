"""A stand-in for the TP ring's communication on one GPU: `StandInRing` has `Ring`'s
interface, and its ``send_recv`` launches `paced_copy` on a side stream: a copy kernel on
``ctas`` CTAs that moves a message's bytes through HBM at a set link bandwidth and holds
its SMs for the whole transfer, as NCCL's kernels do. bench/linear.py drives the real
ring loops with it; docs/tensor_parallel.md gives the link model's sources.
"""

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from fusedpar.kernels.common import sm_count

# The link the stand-in imitates: NCCL between H100 SXM GPUs over NVLink 4 (450 GB/s line
# rate each way). NCCL's maintainers put the effective NVLink bandwidth after protocol
# overhead at ~370 GB/s, the busbw of all-gather/reduce-scatter at large sizes
# (github.com/NVIDIA/nccl-tests/issues/212); users report ~360 GB/s (nccl-tests#312).
# 350 leaves room for the mid-size messages of a ring step. NCCL point-to-point
# (sendrecv_perf), which `Ring` uses, was reported at 80-180 GB/s between two H100s with
# default settings (nccl-tests#268): BENCH_COMM_GBPS=350,150 measures both cases.
COMM_GBPS = 350.0
# A small NCCL send/recv between two H100s over NVLink: ~3 us (NVIDIA/nccl#1487).
COMM_LATENCY_US = 3.0
# NCCL runs one CTA per channel, on the order of 16-32 channels over NVLink: the upper end
# takes the most SMs from the GEMMs (the pessimistic case for overlap).
COMM_CTAS = 32
# One piece per CTA and pacing step: 8 warps x 32 threads x 8 x 16-byte vectors in flight.
PIECE_BYTES = 32 * 1024
COPY_WARPS = 8


@dataclass(frozen=True)
class Link:
    """What the stand-in imitates: ``latency_us + bytes / gbps`` per message, on ``ctas``
    CTAs (GB/s = bytes per ns)."""

    gbps: float = COMM_GBPS
    latency_us: float = COMM_LATENCY_US
    ctas: int = COMM_CTAS

    def __post_init__(self):
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"link bandwidth must be a positive number of GB/s, got {self.gbps}")
        if not self.latency_us >= 0:
            raise ValueError(f"link latency must be >= 0 us, got {self.latency_us}")
        if self.ctas < 1:
            raise ValueError(f"the stand-in needs at least one CTA, got {self.ctas}")

    def nominal_ms(self, nbytes: int) -> float:
        return self.latency_us / 1e3 + nbytes / self.gbps / 1e6


def _env_numbers(name: str, default, kind=float) -> list:
    text = os.environ.get(name, "").strip()
    try:
        return [kind(v) for v in text.split(",")] if text else [default]
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a comma-separated list of numbers") from None


def links_from_env() -> list[Link]:
    """The links to measure: one per ``BENCH_COMM_GBPS`` value (comma-separated), all with
    ``BENCH_COMM_LATENCY_US`` and ``BENCH_COMM_CTAS``; the defaults above otherwise."""
    latency = _env_numbers("BENCH_COMM_LATENCY_US", COMM_LATENCY_US)
    ctas = _env_numbers("BENCH_COMM_CTAS", COMM_CTAS, int)
    if len(latency) != 1 or len(ctas) != 1:
        raise ValueError(
            f"BENCH_COMM_LATENCY_US and BENCH_COMM_CTAS take one value each, got "
            f"{latency} and {ctas}"
        )
    return [Link(gbps, latency[0], ctas[0]) for gbps in _env_numbers("BENCH_COMM_GBPS", COMM_GBPS)]


@dataclass(frozen=True)
class CopyPlan:
    """How `paced_copy` moves ``nbytes``: ``pieces`` of ``block`` elements of
    ``elem_bytes`` each over ``grid`` CTAs; piece p is due ``latency_ns + (p + 1) *
    piece_ps / 1000`` ns after its CTA started."""

    nbytes: int
    elem_bytes: int
    block: int
    pieces: int
    grid: int
    latency_ns: int
    piece_ps: int

    @property
    def numel(self) -> int:
        return self.nbytes // self.elem_bytes

    def due_ns(self, piece: int) -> int:
        """When `piece` is due, after its CTA's start (the kernel's integer arithmetic)."""
        return self.latency_ns + (piece + 1) * self.piece_ps // 1000

    def cta_pieces(self, cta: int) -> range:
        return range(cta, self.pieces, self.grid)


def copy_plan(nbytes: int, elem_bytes: int, link: Link) -> CopyPlan:
    """The pieces, grid and deadlines that make `paced_copy` take ``link.nominal_ms``.

    The message is cut into 32 KiB pieces; CTA c copies pieces c, c + grid, c + 2 grid,
    ... and after piece p spins until ``start_c + latency + (p + 1) * T / pieces`` with
    T = bytes / bandwidth, so the last piece ends ``latency + T`` after the CTAs start
    whenever the copy is faster than its pace (at 350 GB/s over 32 CTAs each must copy
    about 11 GB/s). The deadlines are absolute, so a late spin or a coarse timer tick
    delays one piece, not the ones after it. Left out of the model, and measured by the
    ``standin`` rows: the kernel's launch, CTAs that start late because the GEMM holds the
    SMs (NCCL's would too), and the last tick of the timer.
    """
    if nbytes % elem_bytes:
        raise ValueError(f"{nbytes} bytes are not a whole number of {elem_bytes}-byte elements")
    block = PIECE_BYTES // elem_bytes
    pieces = triton.cdiv(nbytes // elem_bytes, block)
    return CopyPlan(
        nbytes=nbytes,
        elem_bytes=elem_bytes,
        block=block,
        pieces=pieces,
        grid=max(1, min(link.ctas, pieces)),
        latency_ns=round(link.latency_us * 1e3),
        # bytes / (GB/s) is ns; spread evenly over the pieces, in picoseconds
        piece_ps=round(nbytes / link.gbps * 1e3 / max(pieces, 1)),
    )


@triton.jit
def _globaltimer():
    # The GPU's nanosecond clock (PTX %globaltimer); not pure: it must be read every time.
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _paced_copy_kernel(
    # pointers
    src_ptr,
    dst_ptr,
    # sizes
    numel,
    pieces,
    # pacing: piece p is due latency_ns + (p + 1) * piece_ps / 1000 ns after this CTA starts
    latency_ns,
    piece_ps,
    # meta-parameters
    BLOCK: tl.constexpr,
    PACE: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    if PACE:
        start = _globaltimer()
    for p in range(tl.program_id(0), pieces, tl.num_programs(0)):
        idx = p * BLOCK + offs
        mask = idx < numel
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)
        if PACE:
            due = start + latency_ns + tl.cast(p + 1, tl.int64) * piece_ps // 1000
            now = _globaltimer()
            while now < due:
                now = _globaltimer()


def _element_bytes(*tensors: torch.Tensor) -> int:
    """The widest element (4, 2 or 1 bytes) that divides every size and address."""
    fits = lambda size: all(t.nbytes % size == 0 and t.data_ptr() % size == 0 for t in tensors)
    return next(size for size in (4, 2, 1) if fits(size))


def paced_copy(src: torch.Tensor, dst: torch.Tensor, link: Link, *, pace: bool = True) -> CopyPlan:
    """Copy `src`'s bytes into `dst` on the current stream in ``link.nominal_ms(nbytes)``
    (``pace=False``: as fast as ``link.ctas`` CTAs go; the interpreter cannot pace)."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(
            f"paced_copy needs contiguous tensors, got strides {src.stride()} and {dst.stride()}"
        )
    if src.nbytes != dst.nbytes or src.device != dst.device:
        raise ValueError(
            f"paced_copy: {src.nbytes} bytes on {src.device} into {dst.nbytes} "
            f"bytes on {dst.device}"
        )
    if pace and src.device.type != "cuda":
        raise ValueError("paced_copy: pacing reads the GPU's timer; pass pace=False on CPU")
    elem = _element_bytes(src, dst)
    dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem]
    plan = copy_plan(src.nbytes, elem, link)
    if plan.pieces * plan.block >= 2**31:
        raise ValueError(f"paced_copy: {plan.numel} elements overflow the kernel's int32 offsets")
    if plan.numel:
        flat_src = src.reshape(-1).view(torch.uint8).view(dtype)
        flat_dst = dst.reshape(-1).view(torch.uint8).view(dtype)
        _paced_copy_kernel[(plan.grid,)](
            flat_src,
            flat_dst,
            plan.numel,
            plan.pieces,
            plan.latency_ns,
            plan.piece_ps,
            BLOCK=plan.block,
            PACE=pace,
            num_warps=COPY_WARPS,
        )
    return plan


class StandInRing:
    """`Ring`'s interface on one device, for the benchmark: ``size`` ranks of which this
    is ``rank``. ``send_recv(t, out)`` copies t into `out` (or into one of two buffers per
    shape, used in turn, as `Ring` does) with `paced_copy` on a side stream that first
    waits for the caller's stream; ``wait()`` makes the caller's stream wait for the copy
    and returns the buffer. ``link=None`` moves nothing: the loop's cost without
    communication. On CPU (the tests) the copy happens at once, unpaced.
    """

    def __init__(self, size: int, link: Link | None, *, rank: int = 0, device="cuda"):
        self.size, self.rank, self.link = size, rank, link
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self._pending: torch.Tensor | None = None
        self.sent_bytes = 0  # what went through send_recv (tests read it)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        pair = self._buffers.setdefault((tuple(t.shape), t.dtype), [])
        if len(pair) < 2:
            pair.insert(0, torch.zeros(t.shape, dtype=t.dtype, device=t.device))
        pair.reverse()
        return pair[-1]

    def send_recv(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._pending is not None:
            raise RuntimeError("StandInRing.send_recv called again before wait()")
        recv = self._buffer(tensor) if out is None else out
        self.sent_bytes += tensor.nbytes
        if self.link is not None and self.stream is None:
            paced_copy(tensor, recv, self.link, pace=False)
        elif self.link is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                paced_copy(tensor, recv, self.link)
        self._pending = recv
        return recv

    def wait(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("StandInRing.wait called with no send_recv in flight")
        recv, self._pending = self._pending, None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return recv


class _CopyEngine:
    """What both copy-engine stand-ins share: a high-priority side stream, flags written
    by stream writes, sleeps for the link's time (on CPU: none of it, the copies at once,
    for the tests)."""

    def __init__(self, world: int, rank: int, link: Link | None, device, delays_us):
        self.world, self.rank, self.link = world, rank, link
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        self.delays_us = list(delays_us or [0.0] * world)
        self.flags = torch.zeros(world, dtype=torch.int32, device=self.device)
        self.status = None
        if self.gpu:
            from fusedpar import symmetric

            self.stream = torch.cuda.Stream(self.device, priority=-1)
            self.status = symmetric.Watchdog.of(self.device).status
            # SM cycles a µs for the sleeps: the device's clock (kHz; older torch lacks the
            # field: an H100's 1.98 GHz)
            props = torch.cuda.get_device_properties(self.device)
            self._cycles_per_us = (getattr(props, "clock_rate", 0) or 1_980_000) / 1e3

    def _signal(self, flags: torch.Tensor, index: int) -> None:
        if self.gpu:
            from fusedpar import symmetric

            symmetric.signal(flags, index)
        else:
            flags[index] = 1

    def _travel(self, nbytes: int, peer: int) -> None:
        """Queue the link's time for `nbytes` (and peer's extra delay) on this stream."""
        wait_us = self.delays_us[peer]
        if self.link is not None:
            wait_us += self.link.nominal_ms(nbytes) * 1e3
        if self.gpu and wait_us > 0:
            torch.cuda._sleep(int(wait_us * self._cycles_per_us))


class CopyEngineGather(_CopyEngine):
    """`fusedpar.symmetric.Gather`'s interface on one device, taking no SM: this is rank
    `rank` of ``len(peers)``, whose other ranks' shards are `peers` (on this device).
    ``start(x)`` puts x in its rows, flags them, and on a high-priority side stream
    copies each peer's shard into its rows (a device-to-device copy: the copy engine) in
    rank-rotated order, each after a wait of the link's time for it (``torch.cuda._sleep``,
    ``delays_us`` extra per chunk if given: the tests' random producers) and followed by
    its flag (a stream write). ``link=None``: no pacing (the copies' own time only)."""

    def __init__(
        self,
        peers: list[torch.Tensor],
        rank: int,
        link: Link | None,
        *,
        delays_us: list[float] | None = None,
    ):
        super().__init__(len(peers), rank, link, peers[0].device, delays_us)
        self.peers = peers
        # The pacing sleeps are kernels: the fused GEMM leaves them an SM (the real
        # transport's copies and flag writes need none).
        self.programs = sm_count(self.device) - 1 if self.gpu else None

    def start(self, x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        m, rank, world = x.shape[0], self.rank, self.world
        self.flags.zero_()
        gathered[rank * m : (rank + 1) * m].copy_(x)
        self._signal(self.flags, rank)
        if self.gpu:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.gpu else contextlib.nullcontext():
            for step in range(1, world):
                src = (rank + step) % world
                self._travel(self.peers[src].nbytes, src)
                gathered[src * m : (src + 1) * m].copy_(self.peers[src])
                self._signal(self.flags, src)
        return gathered

    def finish(self) -> None:
        if self.gpu:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class CopyEngineScatter(_CopyEngine):
    """`fusedpar.symmetric.Scatter`'s interface on one device: rank `rank` of W, whose
    peers' partials for it are ``incoming`` (W, m, N) (slot `rank` unused). ``run``
    queues, on one side stream, each destination's count wait and the copy of its rows
    (into a local buffer standing for the peer's memory: the copy engine, after the
    link's time); on another, each peer's partial arriving (its copy into ``received``
    after the link's time, then its flag), released as this rank's GEMM finishes the
    same step's chunk (peers run the same GEMM at the same pace); then the GEMM and the
    sum. On CPU: the GEMM, then every copy, then the sum."""

    def __init__(
        self,
        incoming: torch.Tensor,
        rank: int,
        link: Link | None,
        *,
        delays_us: list[float] | None = None,
    ):
        world, m, N = incoming.shape
        super().__init__(world, rank, link, incoming.device, delays_us)
        self.incoming, self.rows = incoming, m
        self.received = torch.zeros_like(incoming)
        self.sink = torch.zeros_like(incoming)
        self.counts = torch.zeros(world, dtype=torch.int32, device=self.device)
        if self.gpu:
            self.arrivals = torch.cuda.Stream(self.device, priority=-1)

    def run(self, pairs, out_dtype, bias, tiles: int, gemm) -> torch.Tensor:
        from fusedpar.kernels import matmul_fused

        m, rank, world = self.rows, self.rank, self.world
        self.flags.zero_()
        self.counts.zero_()
        partials = torch.empty(
            (world * m, self.incoming.shape[2]), dtype=self.incoming.dtype, device=self.device
        )
        chunk_bytes = self.incoming[0].nbytes

        def sends():
            for step in range(1, world):
                dest = (rank + step) % world
                matmul_fused.wait_count(self.counts, dest, tiles, rank, status=self.status)
                self._travel(chunk_bytes, dest)
                self.sink[dest].copy_(partials[dest * m : (dest + 1) * m])

        def arrivals():
            for step in range(1, world):
                src, mine = (rank - step) % world, (rank + step) % world
                matmul_fused.wait_count(self.counts, mine, tiles, rank, status=self.status)
                self._travel(chunk_bytes, src)
                self.received[src].copy_(self.incoming[src])
                self._signal(self.flags, src)

        if not self.gpu:
            gemm(partials, self.counts)
            sends()
            arrivals()
        else:
            current = torch.cuda.current_stream(self.device)
            for stream, queue in ((self.stream, sends), (self.arrivals, arrivals)):
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    queue()
            gemm(partials, self.counts)
            # (the sends and arrivals before the sum, whose spinning CTAs could hold every
            # SM: `fusedpar.symmetric.Scatter.run`)
            current.wait_stream(self.stream)
            current.wait_stream(self.arrivals)
        return matmul_fused.sum_partials(
            partials[rank * m : (rank + 1) * m],
            self.received,
            self.flags,
            rank,
            out_dtype,
            bias,
            status=self.status,
        )
