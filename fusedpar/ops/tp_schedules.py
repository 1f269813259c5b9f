"""The TP GEMMs' schedules over a group, as `fusedpar.ops.linear`'s ops run them (and
the benchmark, with a stand-in ring or transport):

| function                  | computes                                          |
| ------------------------- | ------------------------------------------------- |
| `gather_matmuls`          | ``gather(x) @ operand_i + bias_i`` for each operand |
| `matmuls_reduce_scatter`  | this rank's rows of ``sum_ranks sum_i A_i @ B_i``  |

``chunks`` picks the schedule (`fusedpar.ops.overlap`): `SERIAL` one collective and
one GEMM, a positive count the ring (that many messages per rank and step), `FUSED` the
persistent GEMM (`fusedpar.ops.linear_fused`), `AUTO` the pick measured per shape.
"""

import torch

from fusedpar.comm import (
    Ring,
    all_gather_async,
    group_size,
    reduce_scatter_async,
    tuning_agreement,
)
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.matmul import RowRotation, matmul
from fusedpar.kernels.tuning import Launch, bucket, frozen
from fusedpar.ops.linear_fused import (
    chunk_epilogue,
    fused_takes,
    gather_matmuls_fused,
    matmuls_reduce_scatter_fused,
)
from fusedpar.ops.overlap import AUTO, FUSED, SERIAL, measured_chunks


def _pieces(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Cut `rows` into `chunks` near-equal [start, stop) ranges, dropping empty ones."""
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def gather_matmuls(
    x, operands, biases, pg, chunks, gemm=matmul, ring=None, epilogues=None, outs=None
):
    """``gather(x) @ operand + bias`` for each operand, one ring all-gather for all.

    x (n, K) this rank's rows; operands [(K, N_i)]; biases [(N_i,) or None]. Returns the
    outputs [(W*n, N_i)] (new, or `outs` written) and the gathered x (W*n, K). Step s
    multiplies the rows of rank r - s while those of rank r - s - 1 arrive (received
    straight into their place). `epilogues`: per operand, None or what its GEMM's
    epilogue applies over its whole output's rows, a `RowRotation`, `GatedProduct` or
    `GatedGrad` (whose tensors' rows match the output's: an operand's GEMM may read the
    rows an earlier operand's wrote in the same chunk), of which each chunk's GEMM takes
    its rows' share (`chunk_epilogue`). `gemm` has
    `matmul`'s signature; `ring` replaces ``Ring(pg)`` (the benchmark injects a stand-in).
    The GEMMs are tuned before the first transfer, agreed over `pg`. `chunks` `SERIAL`:
    one all-gather, then each operand's GEMM over all rows.
    """
    epilogues = epilogues or [None] * len(operands)
    n, K = x.shape
    if chunks == AUTO:
        key = (
            bucket(n),
            K,
            tuple(op.shape[1] for op in operands),
            str(x.dtype),
            tuple(e is not None for e in epilogues),
        )
        chunks = measured_chunks(
            "all_gather_matmul",
            key,
            pg,
            x.device,
            lambda c: gather_matmuls(x, operands, biases, pg, c, gemm, ring, epilogues),
        )
    if chunks == FUSED:
        if ring is not None:
            raise ValueError("gather_matmuls: the fused schedule takes no ring")
        if group_size(pg) > 1 and fused_takes(x.dtype):
            return gather_matmuls_fused(x, operands, biases, pg, gemm, epilogues, outs)
        chunks = SERIAL
    if ring is None and (group_size(pg) == 1 or chunks == SERIAL):
        # one rank: plain GEMMs, nothing to gather; serial: one all-gather, then GEMMs
        full = x if group_size(pg) == 1 else all_gather_async(x, pg).wait()
        outs = outs or [None] * len(operands)
        outs = [
            gemm(
                full,
                op,
                bias=bias,
                out=out,
                out_dtype=x.dtype,
                **chunk_epilogue(epilogue, slice(0, full.shape[0])),
            )
            for op, bias, epilogue, out in zip(operands, biases, epilogues, outs, strict=True)
        ]
        return outs, full
    ring = Ring(pg) if ring is None else ring
    size, rank = ring.size, ring.rank
    gathered = x.new_empty((size * n, K))
    gathered[rank * n : (rank + 1) * n].copy_(x)
    outs = outs or [x.new_empty((size * n, op.shape[1])) for op in operands]
    agreement = tuning_agreement(pg, x.device)
    tuning, agreed = Launch(agreement, tune_only=True), Launch(agreement)
    gemms = list(zip(outs, operands, biases, epilogues, strict=True))
    for a, b in _pieces(n, chunks):  # the loop's GEMM shapes, picked before it starts
        for out, op, bias, epilogue in gemms:
            # (a gated epilogue's tuning writes rows the ring writes again)
            gated = epilogue is not None and not isinstance(epilogue, RowRotation)
            gemm(
                x[a:b],
                op,
                bias=bias,
                out=out[a:b] if gated else None,
                out_dtype=x.dtype,
                launch_as=tuning,
                **chunk_epilogue(epilogue, slice(a, b)),
            )
    with frozen("the all-gather ring", agreement):
        for step in range(size):
            src, incoming = (rank - step) % size, (rank - step - 1) % size
            for a, b in _pieces(n, chunks):
                rows = slice(src * n + a, src * n + b)
                if step + 1 < size:
                    arriving = gathered[incoming * n + a : incoming * n + b]
                    ring.send_recv(gathered[rows], out=arriving)
                for out, op, bias, epilogue in gemms:
                    gemm(
                        gathered[rows],
                        op,
                        out=out[rows],
                        bias=bias,
                        launch_as=agreed,
                        **chunk_epilogue(epilogue, rows),
                    )
                if step + 1 < size:
                    ring.wait()
    return outs, gathered


def matmuls_reduce_scatter(
    pairs, pg, chunks, out_dtype, bias=None, gemm=matmul, ring=None, reduce_dtype=None
):
    """This rank's rows of ``sum_ranks sum_i A_i @ B_i`` (+ bias), by a ring reduce-scatter.

    pairs [(A_i (W*m, K_i), B_i (K_i, N))]. At step s rank r computes its fp32 partial for
    rank r - s - 1 while the running sum for that rank arrives from r - 1, adds it, and
    passes it on; after W - 1 steps it holds its own sum. Returns (m, N) in `out_dtype`.
    `gemm` and `ring` as in `gather_matmuls`. (fp32: float64 for float64 A.) `chunks`
    `SERIAL`: every row's partial, then one reduce-scatter of them. `reduce_dtype`: the
    dtype the partials travel in (None: fp32); the ring adds each arriving sum to its own
    fp32 partial and rounds it to `reduce_dtype` to pass it on, the serial schedule's
    collective sums in it. Either way the result is rounded once more, after the bias.
    """
    wide = accumulator(pairs[0][0].dtype)
    if chunks == AUTO:
        key = (
            bucket(pairs[0][0].shape[0]),
            pairs[0][1].shape[1],
            tuple(A.shape[1] for A, _ in pairs),
            str(pairs[0][0].dtype),
            str(out_dtype),
            str(reduce_dtype),
        )

        def run(c):
            return matmuls_reduce_scatter(pairs, pg, c, out_dtype, bias, gemm, ring, reduce_dtype)

        chunks = measured_chunks("matmul_reduce_scatter", key, pg, pairs[0][0].device, run)

    def summed():  # sum_i A_i @ B_i over every row, in fp32
        total = gemm(*pairs[0], out_dtype=wide)
        for A, B in pairs[1:]:
            gemm(A, B, out=total, accumulate=True)
        return total

    if ring is None and group_size(pg) == 1:  # one rank: the fp32 sum, rounded once
        if len(pairs) == 1:  # the GEMM's epilogue adds the bias in fp32 and rounds
            return gemm(*pairs[0], bias=bias, out_dtype=out_dtype)
        total = summed()
        total = total if bias is None else total + bias.to(wide)
        return total if total.dtype == out_dtype else total.to(out_dtype)  # (a no-op .to costs)
    if chunks == FUSED:
        if ring is not None:
            raise ValueError("matmuls_reduce_scatter: the fused schedule takes no ring")
        if group_size(pg) > 1 and fused_takes(pairs[0][0].dtype, len(pairs)):
            return matmuls_reduce_scatter_fused(pairs, pg, out_dtype, bias, reduce_dtype)
        chunks = SERIAL
    if ring is None and chunks == SERIAL:  # every row's fp32 partial, one reduce-scatter
        total = summed()
        sent = total if reduce_dtype is None else total.to(reduce_dtype)
        mine = reduce_scatter_async(sent, pg).wait().to(wide)
        return (mine if bias is None else mine + bias.to(wide)).to(out_dtype)  # rounded once
    ring = Ring(pg) if ring is None else ring
    size, rank = ring.size, ring.rank
    rows, N = pairs[0][0].shape[0] // size, pairs[0][1].shape[1]
    device = pairs[0][0].device
    out = torch.empty((rows, N), dtype=out_dtype, device=device)
    running = {}
    agreement = tuning_agreement(pg, device)
    tuning, agreed = Launch(agreement, tune_only=True), Launch(agreement)
    for a, b in _pieces(rows, chunks):  # the loop's GEMM shapes, picked before it starts
        for i, (A, B) in enumerate(pairs):
            gemm(A[a:b], B, out_dtype=wide, accumulate=i > 0, launch_as=tuning)
    with frozen("the reduce-scatter ring", agreement):
        for step in range(size):
            dest = (rank - step - 1) % size
            for a, b in _pieces(rows, chunks):
                partial = torch.empty((b - a, N), dtype=wide, device=device)
                if step > 0:  # the sum for rank dest - 1 goes on (in reduce_dtype if given)
                    sent = running[a] if reduce_dtype is None else running[a].to(reduce_dtype)
                    ring.send_recv(sent)
                for i, (A, B) in enumerate(pairs):
                    gemm(
                        A[dest * rows + a : dest * rows + b],
                        B,
                        out=partial,
                        accumulate=i > 0,
                        launch_as=agreed,
                    )
                if step > 0:
                    partial += ring.wait()  # the sum for `dest` so far, from rank - 1
                running[a] = partial
    for a, b in _pieces(rows, chunks):
        out[a:b] = running[a] if bias is None else running[a] + bias.to(wide)  # rounded once
    return out
