"""The fused tensor-parallel schedule's kernels: one persistent GEMM that takes its rows'
chunks as they land (all-gather) or hands each destination's partial rows on as soon as
they are done (reduce-scatter), and the small kernels around it.

Rows come in W chunks of m rows (one a rank), A (W*m, K) with chunk c at rows c*m.

| kernel (launcher)  | computes, and its signal                                              |
| ------------------ | --------------------------------------------------------------------- |
| `gathered_matmuls` | ``C_i = A @ B_i + bias_i``, 1-3 weights; a tile of chunk c waits for  |
|                    | ``flags[c] >= 1``                                                     |
| `partial_matmuls`  | ``P = sum_i A_i @ B_i`` (1-3 pairs), fp32 or the reduce dtype; each   |
|                    | tile of chunk c does ``counts[c] += 1``                               |
| `sum_partials`     | ``out = sum_s P_s + bias``, rounded once; waits for ``flags[s] >= 1`` |
| `wait_count`       | one program, for a copy stream: waits for ``counts[c] >= n``          |

Tiles go in arrival order (all-gather: this rank's chunk, then rank + 1, ...;
reduce-scatter: rank + 1's rows first, this rank's own last). A wait that outlasts
``wait_s`` (the GPU's global timer) writes (op, rank, chunk) into `status`, pinned host
memory the watchdog reads (`fusedpar.symmetric`), and traps. How the waits, counts and
loop are built, and the interpreter's rule: docs/tensor_parallel.md.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.common import (
    accumulator,
    cdiv,
    check_float_dtype,
    check_launchable,
    device_guard,
    ensure_tma_allocator,
    fp32_dot_precision,
    is_interpreted,
    next_power_of_2,
    sm_count,
)
from fusedpar.kernels.matmul import (
    BLOCK_K,
    GROUP_M,
    _load_operand,
    _operand_source,
    _prune_configs,
    matmul_configs,
    tile_of,
)
from fusedpar.kernels.tuning import LAUNCH, Launch, bucket

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "reduce_scatter_sum")  # status codes 1-3
MAX_OPERANDS = 3  # QKV
SUM_BLOCK_M, SUM_BLOCK_N = 32, 128  # sum_partials' tile: a memory-bound pass
INTERPRETER_BLOCK = 32


def fused_configs(dtype: torch.dtype, rows: int, N: int) -> list[triton.Config]:
    """The persistent GEMM's tiles: `matmul`'s for dtype (fp32 partials in the
    reduce-scatter are written, not added into: the non-accumulating list), pruned for a
    chunk of `rows` rows and N columns."""
    return _prune_configs(matmul_configs(dtype, False), rows, N)


@triton.jit
def _now():
    """The GPU's global timer, ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _stop(status_ptr, op, rank, chunk):
    """Record (op, rank, chunk) in the pinned status for the host, then trap. The op is
    stored last, after a system fence: the host reads it as the record's presence."""
    tl.store(status_ptr + 1, rank)
    tl.store(status_ptr + 2, chunk)
    tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip
    tl.store(status_ptr, op)
    tl.inline_asm_elementwise("fence.sc.sys; trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@triton.jit
def wait_flag(flag_ptr, target, wait_ns, status_ptr, op, rank, chunk, SCOPE: tl.constexpr,
              ON_GPU: tl.constexpr):  # fmt: skip
    """Return once ``*flag_ptr >= target`` (acquire at SCOPE: "gpu" for a flag this GPU's
    copy engine writes, "sys" for one a peer writes); past `wait_ns`, `_stop`. On a GPU
    every thread loads the flag with ``ld.acquire`` (no read-modify-write on the flag's
    line while it spins, and each thread's own acquire orders its reads after it)."""
    if ON_GPU:
        seen = _load_acquire(flag_ptr, SCOPE)
        if seen < target:
            start = _now()
            waited = start - start
            while (seen < target) & (waited < wait_ns):
                seen = _load_acquire(flag_ptr, SCOPE)
                waited = _now() - start
            if seen < target:
                _stop(status_ptr, op, rank, chunk)
        # The chunk was written by the copy engine; TMA reads through the async proxy.
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:  # the interpreter: the flags are set before the launch
        tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)


@triton.jit
def _load_acquire(ptr, SCOPE: tl.constexpr):
    """``*ptr`` (int32) loaded with acquire semantics at SCOPE ("gpu" or "sys")."""
    if SCOPE == "sys":
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _chunk_source(ptr, W, m, K, stride_m, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """A (W, m, K) view of an operand's rows for TMA: a tile stops at its chunk's end."""
    if TMA:
        return tl.make_tensor_descriptor(ptr, shape=[W, m, K],
                                         strides=[m * stride_m, stride_m, 1],
                                         block_shape=[1, BLOCK_M, BLOCK_K])  # fmt: skip
    else:
        return None


@triton.jit
def _product(acc, a_ptr, a_desc, b_ptr, b_desc, chunk, row, start_n, m, K, N, stride_am,
             stride_ak, stride_bk, stride_bn, TMA: tl.constexpr, B_T: tl.constexpr,
             INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc + A[chunk rows row:row+BLOCK_M] @ B[:, start_n:start_n+BLOCK_N]``, the K loop.
    Through pointers, rows past the chunk wrap onto its own (only the store is masked)."""
    if TMA:
        for ki in tl.range(0, tl.cdiv(K, BLOCK_K)):
            a = tl.reshape(a_desc.load([chunk, row, ki * BLOCK_K]), (BLOCK_M, BLOCK_K))
            b = _load_operand(b_desc, ki * BLOCK_K, start_n, B_T)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    else:
        rows = (chunk * m + (row + tl.arange(0, BLOCK_M)) % m).to(tl.int64)
        cols = ((start_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _store(acc, c_ptr, bias_ptr, chunk, row, start_n, m, N, stride_cm, HAS_BIAS: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """C's tile (rows of `chunk`, bias added in fp32, rounded once), masked to the chunk."""
    offs_r = row + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    rows = (chunk * m + offs_r).to(tl.int64)
    mask = (offs_r < m)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _pick(i, x0, x1, x2):
    """x0, x1 or x2 by the runtime index i (pointers, strides, sizes)."""
    return tl.where(i == 0, x0, tl.where(i == 1, x1, x2))


@triton.jit
def _fused_matmul_kernel(
    # pointers (operand i: A_i, B_i, bias_i, C_i; the gather has one A, the scatter one C)
    a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, bias0_ptr, bias1_ptr, bias2_ptr,
    c0_ptr, c1_ptr, c2_ptr, signal_ptr, status_ptr, trace_ptr,
    # strides
    stride_a0m, stride_a1m, stride_a2m, stride_ak, stride_b0k, stride_b0n, stride_b1k,
    stride_b1n, stride_b2k, stride_b2n, stride_c0m, stride_c1m, stride_c2m,
    # sizes
    m, W, rank, K0, K1, K2, N0, N1, N2, wait_ns,
    # meta-parameters
    GATHER: tl.constexpr,
    OPERANDS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    B_T: tl.constexpr,
    ON_GPU: tl.constexpr,
    TRACE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Persistent: program p takes tiles p, p + programs, ... of W chunk slots, slot s
    holding chunk (rank + s) % W (GATHER) or (rank + 1 + s) % W (scatter), each chunk's
    tiles in grouped order over its row blocks and the column blocks.

    GATHER: C_i = A0 @ B_i + bias_i, the column blocks those of B_0, B_1, B_2 in turn
    (one weight's per tile); the tile first waits for ``signal[chunk] >= 1``.
    Scatter: C0 = sum_i A_i @ B_i over the N0 columns; after the tile,
    ``signal[chunk] += 1``. HAS_BIAS: every bias is read (the launcher passes zeros for
    a weight without one: adding 0 in fp32 changes nothing). TRACE: ``trace[p * tiles
    + j]`` = the j-th tile of program p (tests read the order).

    One K loop serves every operand: with several, a tile makes its operands'
    descriptors from the picked pointers (a K loop per operand, one in each branch,
    kept three pipelines' shared memory: 433 KiB at 128x256, over an H100's 227)."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    blocks0 = tl.cdiv(N0, BLOCK_N)
    if GATHER:
        blocks1 = tl.cdiv(N1, BLOCK_N) if OPERANDS > 1 else 0
        blocks2 = tl.cdiv(N2, BLOCK_N) if OPERANDS > 2 else 0
    else:
        blocks1 = 0
        blocks2 = 0
    tiles_n = blocks0 + blocks1 + blocks2
    per_chunk = tiles_m * tiles_n
    first = 0 if GATHER else 1
    a_desc = None
    b_desc = None
    if TMA and OPERANDS == 1:  # made once
        a_desc = _chunk_source(a0_ptr, W, m, K0, stride_a0m, TMA, BLOCK_M, BLOCK_K)
        b_desc = _operand_source(b0_ptr, K0, N0, stride_b0n if B_T else stride_b0k, B_T,
                                 BLOCK_K, BLOCK_N)  # fmt: skip
    j = 0
    for tile in range(tl.program_id(0), W * per_chunk, tl.num_programs(0)):
        chunk = (rank + first + tile // per_chunk) % W
        pid_m, pid_n = tile_of(tile % per_chunk, tiles_m, tiles_n, GROUP_M)
        row = pid_m * BLOCK_M
        if TRACE:
            tl.store(trace_ptr + tl.program_id(0) * W * per_chunk + j, chunk * per_chunk
                     + pid_m * tiles_n + pid_n)  # fmt: skip
            j += 1
        if GATHER:  # this tile's weight, and its first column
            wait_flag(signal_ptr + chunk, 1, wait_ns, status_ptr, 1, rank, chunk, "gpu", ON_GPU)
            op = (pid_n >= blocks0).to(tl.int32) + (pid_n >= blocks0 + blocks1).to(tl.int32)
            start_n = (pid_n - _pick(op, 0, blocks0, blocks0 + blocks1)) * BLOCK_N
            ops_end = op + 1
        else:
            op = 0
            start_n = pid_n * BLOCK_N
            ops_end = OPERANDS
        N = _pick(op, N0, N1, N2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(op, ops_end):
            a_ptr = a0_ptr if GATHER else _pick(i, a0_ptr, a1_ptr, a2_ptr)
            stride_am = stride_a0m if GATHER else _pick(i, stride_a0m, stride_a1m, stride_a2m)
            b_ptr = _pick(i, b0_ptr, b1_ptr, b2_ptr)
            stride_bk = _pick(i, stride_b0k, stride_b1k, stride_b2k)
            stride_bn = _pick(i, stride_b0n, stride_b1n, stride_b2n)
            K = _pick(i, K0, K1, K2)
            if TMA and OPERANDS > 1:
                a_src = _chunk_source(a_ptr, W, m, K, stride_am, TMA, BLOCK_M, BLOCK_K)
                b_src = _operand_source(b_ptr, K, N, stride_bn if B_T else stride_bk, B_T,
                                        BLOCK_K, BLOCK_N)  # fmt: skip
            else:
                a_src = a_desc
                b_src = b_desc
            acc = _product(acc, a_ptr, a_src, b_ptr, b_src, chunk, row, start_n, m, K, N,
                           stride_am, stride_ak, stride_bk, stride_bn, TMA, B_T,
                           INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        c_ptr = _pick(op, c0_ptr, c1_ptr, c2_ptr)
        bias_ptr = _pick(op, bias0_ptr, bias1_ptr, bias2_ptr)
        stride_cm = _pick(op, stride_c0m, stride_c1m, stride_c2m)
        _store(acc, c_ptr, bias_ptr, chunk, row, start_n, m, N, stride_cm, HAS_BIAS and GATHER,
               BLOCK_M, BLOCK_N)  # fmt: skip
        if not GATHER:
            tl.debug_barrier()  # every thread's stores, before the count is released
            tl.atomic_add(signal_ptr + chunk, 1, sem="release", scope="gpu")


@triton.jit
def _sum_partials_kernel(
    # pointers
    own_ptr, received_ptr, bias_ptr, out_ptr, flags_ptr, status_ptr,
    # strides
    stride_own, stride_rs, stride_rm, stride_out,
    # sizes
    m, N, W, rank, wait_ns,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ON_GPU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out = sum over s of this rank's partial from rank s (own: this rank's own rows of
    P; the others: ``received[s]``, each waited for on ``flags[s]``), in fp32 and in the
    order s = 0 .. W-1 whatever the arrival order, + bias, rounded once."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < N)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, W):
        if s == rank:
            part = tl.load(own_ptr + rows * stride_own + offs_n[None, :], mask=mask, other=0.0)
        else:
            wait_flag(flags_ptr + s, 1, wait_ns, status_ptr, 3, rank, s, "sys", ON_GPU)
            part = tl.load(received_ptr + s * stride_rs + rows * stride_rm + offs_n[None, :],
                           mask=mask, other=0.0)  # fmt: skip
        acc += part.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def _wait_count_kernel(counts_ptr, status_ptr, chunk, target, rank, wait_ns, ON_GPU: tl.constexpr):
    """Return once ``counts[chunk] >= target``: queued on a copy stream before the copy of
    chunk's partials, it holds the copy engine until the GEMM has written them."""
    wait_flag(counts_ptr + chunk, target, wait_ns, status_ptr, 2, rank, chunk, "gpu", ON_GPU)


# --- launchers ---


@dataclass(frozen=True, slots=True)
class Signals:
    """How a fused GEMM meets its transport (`fusedpar.symmetric` sets it up): `flags`
    int32 (world,), the gather's (chunk c landed) or the scatter's counts (tiles of chunk
    c written); this `rank` of `world`; `status`, where a stopped wait writes (None: a
    scratch of the launcher's), after `wait_s` (the module doc); `trace` int32 (programs *
    tiles,): each program's tiles in order (tests)."""

    flags: torch.Tensor
    rank: int
    world: int
    status: torch.Tensor | None = None
    wait_s: float = 30.0
    trace: torch.Tensor | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")


_STATUS: dict[torch.device, torch.Tensor] = {}


def _status(device: torch.device, status: torch.Tensor | None) -> torch.Tensor:
    """Where a stopped wait writes (op, rank, chunk): the caller's (pinned host memory a
    watchdog reads), else a device scratch of its own (the trap still stops the kernel)."""
    if status is not None:
        return status
    if device not in _STATUS:
        _STATUS[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return _STATUS[device]


def _check_signal(name: str, signal: torch.Tensor, world: int, device, must_be_set: bool,
                  unread: int = -1) -> None:  # fmt: skip
    if signal.dtype != torch.int32 or signal.shape != (world,) or signal.device != device:
        raise ValueError(f"{name} must be int32 ({world},) on {device}, got {signal.dtype} "
                         f"{tuple(signal.shape)} on {signal.device}")  # fmt: skip
    missing = [] if not must_be_set or device.type == "cuda" else [
        i for i, v in enumerate(signal.tolist()) if v < 1 and i != unread]  # fmt: skip
    if missing:
        raise ValueError(
            f"{name} {missing} are not set: in Triton's interpreter (one program at a time) "
            "nothing can set them while the kernel waits, so set every flag before the launch"
        )


def _wait_ns(wait_s: float) -> int:
    if not wait_s > 0:
        raise ValueError(f"wait_s must be positive, got {wait_s}")
    return int(wait_s * 1e9)


def _operand_layout(operands) -> tuple[bool, bool]:
    """(TMA, B_T): TMA when every operand is 16-bit and aligned, and every B is read the
    same way (B_T: K-contiguous, a weight read as ``w.T``)."""
    b_t = {b.stride(0) == 1 and b.stride(1) != 1 for _, b in operands}
    aligned = all(a.dtype in (torch.float16, torch.bfloat16) and a.stride(-1) == 1
                  and common.tma_compatible(a, b) for a, b in operands)  # fmt: skip
    tma = aligned and len(b_t) == 1
    return tma, tma and b_t.pop()


def _launch(name: str, operands, outs, biases, signals: Signals, rows: int, gather: bool,
            launch_as: Launch, programs: int | None) -> triton.Config:  # fmt: skip
    """Tune (or look up) and launch `_fused_matmul_kernel` for 1-3 (A, B) operands;
    returns the config. With ``launch_as.tune_only``, the pick is made on scratch (the
    gather's rows zeros and every flag set; the counts zeroed) and nothing else is
    launched; a pick already made returns at once, allocating nothing."""
    signal, rank, world = signals.flags, signals.rank, signals.world
    a0 = operands[0][0]
    device = a0.device
    interpreted = is_interpreted(_fused_matmul_kernel)
    tma, b_t = _operand_layout(operands)
    K_s = [a.shape[1] if not gather else a0.shape[1] for a, _ in operands]
    N_s = [b.shape[1] for _, b in operands]
    precision = fp32_dot_precision() if a0.dtype == torch.float32 else "tf32"
    has_bias = any(b is not None for b in biases)
    key = (bucket(rows), world, tuple(K_s), tuple(N_s), str(a0.dtype), str(outs[0].dtype),
           has_bias, precision, tma, b_t)  # fmt: skip
    if launch_as.tune_only:
        scope = (getattr(launch_as.agreement, "name", None), tuning._full_key(key))
        if scope in tuning.tuner(name).picks:
            return tuning.tuner(name).picks[scope]
        if gather:
            operands = [(torch.zeros_like(a0), b) for _, b in operands]
            a0, signal = operands[0][0], torch.ones_like(signal)
        else:
            signal = torch.zeros_like(signal)
        outs = [o.new_empty((world * rows, o.shape[1])) for o in outs]
    if tma:
        ensure_tma_allocator(device)
    pad = lambda ts, fill: list(ts) + [fill] * (MAX_OPERANDS - len(ts))  # noqa: E731
    a_s = pad([a for a, _ in operands], a0)
    b_s = pad([b for _, b in operands], operands[0][1])
    # One bias pointer type for every operand: biases of mixed dtypes go as fp32, where
    # they are added anyway (exact), and a weight without one gets zeros.
    given = [b for b in biases if b is not None]
    bias_dtype = given[0].dtype if len({b.dtype for b in given}) == 1 else torch.float32
    zeros = None
    if has_bias and len(given) < len(biases):
        zeros = torch.zeros(max(B.shape[1] for _, B in operands), dtype=bias_dtype, device=device)
    bias_s = pad([zeros if b is None else b.to(bias_dtype) for b in biases] if has_bias
                 else [outs[0]] * len(biases), outs[0])  # fmt: skip
    c_s = pad(outs, outs[0])
    K_s, N_s = pad(K_s, 0), pad(N_s, 0)
    status, trace = _status(device, signals.status), signals.trace
    args = (*a_s, *b_s, *bias_s, *c_s, signal, status, trace if trace is not None else signal,
            *(a.stride(0) for a in a_s), a0.stride(1),
            *(s for b in b_s for s in b.stride()), *(c.stride(0) for c in c_s),
            rows, world, rank, *K_s, *N_s, _wait_ns(signals.wait_s))  # fmt: skip
    meta = dict(GATHER=gather, OPERANDS=len(operands), HAS_BIAS=has_bias, TMA=tma, B_T=b_t,
                ON_GPU=not interpreted, TRACE=trace is not None, INPUT_PRECISION=precision,
                GROUP_M=GROUP_M)  # fmt: skip
    widths = [n for n in N_s if n] if gather else N_s[:1]  # (the scatter's pairs share N)
    widest = sum(widths)
    if programs is None:
        programs = 2 if interpreted else sm_count(device)

    def launch(config):
        tiles = world * _chunk_tiles(config, rows, widths)
        _fused_matmul_kernel[(min(tiles, programs),)](*args, **meta, **config.all_kwargs())

    def candidates():
        if interpreted:
            block_m = min(INTERPRETER_BLOCK, max(16, next_power_of_2(rows)))
            block_n = min(INTERPRETER_BLOCK, max(16, next_power_of_2(max(N_s))))
            return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K})]
        return fused_configs(a0.dtype, rows, widest)

    if rows == 0 or widest == 0:
        return candidates()[0]
    with device_guard(a0):
        return tuning.tuner(name).run(key, candidates, launch, device=device,
                                       launch_as=launch_as)  # fmt: skip


def gathered_matmuls(gathered: torch.Tensor, weights, biases, signals: Signals, *,
                     launch_as: Launch = LAUNCH,
                     programs: int | None = None) -> list[torch.Tensor] | None:  # fmt: skip
    """``gathered @ B_i + bias_i`` for 1-3 operands B_i (K, N_i) (a weight's ``w.t()``), one
    launch, as the chunks land: chunk c (rows c*m, m = rows / world) is read once
    ``signals.flags[c] >= 1``. Returns the outputs (world*m, N_i) in gathered's dtype.

    gathered (world*m, K) contiguous; biases [(N_i,) or None]; `Signals` (the flags: in
    the interpreter, all set before the call). ``launch_as`` (`Launch`) with ``tune_only``:
    make the pick (on scratch, flags set), launch nothing."""
    flags, world, tune_only = signals.flags, signals.world, launch_as.tune_only
    if not 1 <= len(weights) <= MAX_OPERANDS or len(biases) != len(weights):
        raise ValueError(f"gathered_matmuls takes 1 to {MAX_OPERANDS} weights with a bias (or "
                         f"None) each, got {len(weights)} and {len(biases)}")  # fmt: skip
    check_float_dtype("gathered", gathered, impl.KERNEL_DTYPES)
    T, K = gathered.shape
    if T % world or not gathered.is_contiguous():
        raise ValueError(f"gathered must be contiguous with rows divisible by world = {world}, "
                         f"got {tuple(gathered.shape)} (strides {gathered.stride()})")  # fmt: skip
    for i, (b, bias) in enumerate(zip(weights, biases, strict=True)):
        if b.dim() != 2 or b.shape[0] != K or b.dtype != gathered.dtype:
            raise ValueError(f"weight {i} must be ({K}, N) {gathered.dtype}, got "
                             f"{tuple(b.shape)} {b.dtype}")  # fmt: skip
        if bias is not None and (bias.shape != (b.shape[1],) or not bias.is_contiguous()):
            raise ValueError(f"bias {i} must be contiguous ({b.shape[1]},), got "
                             f"{tuple(bias.shape)}")  # fmt: skip
    check_launchable(_fused_matmul_kernel, gathered, *weights, flags,
                     *(b for b in biases if b is not None))  # fmt: skip
    _check_signal("flags", flags, world, gathered.device, must_be_set=not tune_only)
    outs = [gathered.new_empty((0 if tune_only else T, b.shape[1])) for b in weights]
    _launch("fused_all_gather_matmul", [(gathered, b) for b in weights], outs, biases, signals,
            T // world, True, launch_as, programs)  # fmt: skip
    return None if tune_only else outs


def partial_matmuls(pairs, signals: Signals, *, out_dtype: torch.dtype | None = None,
                    out: torch.Tensor | None = None, launch_as: Launch = LAUNCH,
                    programs: int | None = None) -> torch.Tensor | triton.Config:  # fmt: skip
    """``P = sum_i A_i @ B_i`` for 1-3 pairs A_i (world*m, K_i), B_i (K_i, N), written
    chunk by chunk from rank + 1's rows to this rank's own, the counts ``signals.flags[c]``
    raised by one after each tile of chunk c (its tiles: `partial_tiles`). Returns P
    (world*m, N) in `out_dtype` (fp32 by default; `out` if given, unit column stride).
    ``launch_as`` (`Launch`) with ``tune_only``: make the pick (on scratch) and return its
    config, which says how many tiles a chunk has."""
    counts, world, tune_only = signals.flags, signals.world, launch_as.tune_only
    if not 1 <= len(pairs) <= MAX_OPERANDS:
        raise ValueError(f"partial_matmuls takes 1 to {MAX_OPERANDS} pairs, got {len(pairs)}")
    a0, b0 = pairs[0]
    T, N = a0.shape[0], b0.shape[1]
    check_float_dtype("A", a0, impl.KERNEL_DTYPES)
    for i, (a, b) in enumerate(pairs):
        shaped = a.dim() == 2 and a.shape[0] == T and b.shape == (a.shape[1], N)
        if not shaped or (a.dtype, b.dtype, a.stride(1)) != (a0.dtype, a0.dtype, a0.stride(1)):
            raise ValueError(
                f"pair {i} must be A ({T}, K) and B (K, {N}) of {a0.dtype} with A's column "
                f"stride {a0.stride(1)}, got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)}"
            )  # fmt: skip
    if T % world:
        raise ValueError(f"A's rows ({T}) must divide by world = {world}")
    out_dtype = out.dtype if out is not None else out_dtype or accumulator(a0.dtype)
    if out is None:  # (with tune_only: a shape for the key, the scratch is made if needed)
        out = torch.empty((T, N) if not tune_only else (0, N), dtype=out_dtype, device=a0.device)
    elif out.shape != (T, N) or out.stride(1) != 1:
        raise ValueError(f"out must be ({T}, {N}) with unit column stride, got "
                         f"{tuple(out.shape)} {out.stride()}")  # fmt: skip
    check_launchable(_fused_matmul_kernel, a0, out, counts, *(t for p in pairs for t in p))
    _check_signal("counts", counts, world, a0.device, must_be_set=False)
    config = _launch("fused_matmul_reduce_scatter", list(pairs), [out], [None] * len(pairs),
                     signals, T // world, False, launch_as, programs)  # fmt: skip
    return config if tune_only else out


def partial_tiles(config: triton.Config, rows: int, N: int) -> int:
    """How many tiles of one chunk `partial_matmuls` counts with `config`."""
    return _chunk_tiles(config, rows, [N])


def _chunk_tiles(config: triton.Config, rows: int, widths) -> int:
    """The tiles of one chunk of `rows` rows whose outputs have `widths` columns."""
    block_n = config.kwargs["BLOCK_N"]
    return cdiv(rows, config.kwargs["BLOCK_M"]) * sum(cdiv(n, block_n) for n in widths)


def sum_partials(own: torch.Tensor, received: torch.Tensor, flags: torch.Tensor, rank: int,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                 status: torch.Tensor | None = None,
                 wait_s: float = 30.0) -> torch.Tensor:  # fmt: skip
    """This rank's rows of the reduce-scatter: own (m, N) its own partial, received
    (world, m, N) the others' (slot `rank` unread), each read once ``flags[s] >= 1``;
    summed in fp32 in rank order, bias added, rounded once to `out_dtype`."""
    world, m, N = received.shape
    if own.shape != (m, N) or own.stride(1) != 1 or received.stride(2) != 1:
        raise ValueError(f"own must be ({m}, {N}) like received's slots {tuple(received.shape)}, "
                         f"with unit column strides, got {tuple(own.shape)}")  # fmt: skip
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be ({N},), got {tuple(bias.shape)}")
    check_launchable(_sum_partials_kernel, own, received, flags)
    _check_signal("flags", flags, world, own.device, must_be_set=True, unread=rank)
    out = torch.empty((m, N), dtype=out_dtype, device=own.device)
    if m == 0 or N == 0:
        return out
    grid = (cdiv(m, SUM_BLOCK_M), cdiv(N, SUM_BLOCK_N))
    with device_guard(own):
        _sum_partials_kernel[grid](
            own, received, bias if bias is not None else own, out, flags,
            _status(own.device, status), own.stride(0), received.stride(0), received.stride(1),
            out.stride(0), m, N, world, rank, _wait_ns(wait_s), HAS_BIAS=bias is not None,
            ON_GPU=not is_interpreted(_sum_partials_kernel), BLOCK_M=SUM_BLOCK_M,
            BLOCK_N=SUM_BLOCK_N,
        )  # fmt: skip
    return out


def wait_count(counts: torch.Tensor, chunk: int, target: int, rank: int, *,
               status: torch.Tensor | None = None, wait_s: float = 30.0) -> None:  # fmt: skip
    """Queue a wait for ``counts[chunk] >= target`` on the current stream (one program)."""
    with device_guard(counts):
        _wait_count_kernel[(1,)](counts, _status(counts.device, status), chunk, target, rank,
                                 _wait_ns(wait_s), ON_GPU=not is_interpreted(_wait_count_kernel),
                                 num_warps=1)  # fmt: skip
