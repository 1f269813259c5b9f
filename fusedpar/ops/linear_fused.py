"""The fused schedule of `fusedpar.ops.linear`'s GEMMs (``overlap="fused"``): one
persistent GEMM launch per direction, fed and drained by `fusedpar.symmetric`.

| op side          | launches                                                        |
| ---------------- | --------------------------------------------------------------- |
| all-gather       | `gathered_matmuls` (1-3 weights each), waiting per tile on the  |
|                  | chunks the copy engine pulls                                    |
| reduce-scatter   | `partial_matmuls` (1-3 pairs, one SM left to the copy stream's  |
|                  | waits), then `sum_partials`                                     |

An operand with an epilogue (a gated MLP's gradient) runs `matmul` over the gathered
rows once they are all there, said once (`symmetric.say_once`). What the kernels do not
take at all (float64, more than 3 reduce-scatter pairs) the caller runs serially
(`fused_takes`).
"""

import torch
from torch import Tensor

from fusedpar import symmetric
from fusedpar.comm import tuning_agreement
from fusedpar.kernels import matmul_fused
from fusedpar.kernels.common import accumulator, sm_count
from fusedpar.kernels.impl import KERNEL_DTYPES
from fusedpar.kernels.matmul import RowRotation, matmul
from fusedpar.kernels.tuning import Launch, frozen


def fused_takes(dtype: torch.dtype, pairs: int = 1) -> bool:
    """Whether the fused kernels take operands of `dtype` (and `pairs` reduce-scatter
    pairs); else the caller runs the serial schedule and says so once."""
    if dtype in KERNEL_DTYPES and pairs <= matmul_fused.MAX_OPERANDS:
        return True
    symmetric.say_once(
        f"overlap='fused': {dtype} operands or {pairs} summed pairs run the "
        "serial schedule (the fused kernels take 16-bit and fp32, 1-3 pairs)"
    )
    return False


def chunk_epilogue(epilogue, rows: slice) -> dict:
    """The `matmul` keyword of a GEMM writing `rows` of an output whose epilogue is
    `epilogue` over all its rows: a rotation from the chunk's first row, a gated
    epilogue's tensors cut to the chunk's rows."""
    if epilogue is None:
        return {}
    if isinstance(epilogue, RowRotation):
        return {"rope": epilogue._replace(first_row=rows.start)}
    return {"gated": type(epilogue)(*(t[rows] if isinstance(t, Tensor) else t for t in epilogue))}


def gather_matmuls_fused(
    x: Tensor, operands, biases, pg, gemm=matmul, epilogues=None, outs=None, side=None
):
    """`fusedpar.ops.linear.gather_matmuls`'s result ([outs], gathered) by the fused
    schedule (`outs`: written where given). `side` replaces the symmetric-memory
    `symmetric.Gather` (the benchmark's copy-engine stand-in,
    `bench.standin.CopyEngineGather`)."""
    epilogues = epilogues or [None] * len(operands)
    if side is None:
        side = symmetric.transport(symmetric.Gather, pg, x.shape[0], x.shape[1], x.dtype, x.device)
    plain = [i for i, e in enumerate(epilogues) if e is None]
    groups = [
        plain[i : i + matmul_fused.MAX_OPERANDS]
        for i in range(0, len(plain), matmul_fused.MAX_OPERANDS)
    ]
    agreement = tuning_agreement(pg, x.device)
    gathered = x.new_empty((side.world * x.shape[0], x.shape[1]))
    wait_s = symmetric.wait_seconds()
    signals = matmul_fused.Signals(side.flags, side.rank, side.world, side.status, wait_s)
    tuning = Launch(agreement, tune_only=True)
    for group in groups:  # picked before any transfer, agreed over the group
        matmul_fused.gathered_matmuls(
            gathered,
            [operands[i] for i in group],
            [biases[i] for i in group],
            signals,
            launch_as=tuning,
        )
    made: list = [None] * len(operands)
    side.start(x, gathered)
    with frozen("the fused all-gather", agreement):
        for group in groups:
            results = matmul_fused.gathered_matmuls(
                gathered,
                [operands[i] for i in group],
                [biases[i] for i in group],
                signals,
                launch_as=Launch(agreement),
                programs=getattr(side, "programs", None),
            )
            for i, out in zip(group, results, strict=True):
                made[i] = out if outs is None or outs[i] is None else outs[i].copy_(out)
    side.finish()
    for i, epilogue in enumerate(epilogues):
        if epilogue is not None:
            symmetric.say_once("overlap='fused': a GEMM with an epilogue runs after the gather")
            made[i] = gemm(
                gathered,
                operands[i],
                bias=biases[i],
                out_dtype=x.dtype,
                out=None if outs is None else outs[i],
                **chunk_epilogue(epilogue, slice(0, gathered.shape[0])),
            )
    return made, gathered


def matmuls_reduce_scatter_fused(pairs, pg, out_dtype, bias=None, reduce_dtype=None, side=None):
    """`fusedpar.ops.linear.matmuls_reduce_scatter`'s result by the fused schedule. `side`
    replaces `symmetric.Scatter` (`bench.standin.CopyEngineScatter`)."""
    A0 = pairs[0][0]
    world = pg.size() if side is None else side.world
    rows, N = A0.shape[0] // world, pairs[0][1].shape[1]
    dtype = reduce_dtype or accumulator(A0.dtype)
    if side is None:
        side = symmetric.transport(symmetric.Scatter, pg, rows, N, dtype, A0.device)
    agreement = tuning_agreement(pg, A0.device)
    # one SM for the copy stream's waits (the interpreter's grid is the launcher's own)
    programs = sm_count(A0.device) - 1 if A0.is_cuda else None
    signals = matmul_fused.Signals(side.counts, side.rank, world)
    tuning = Launch(agreement, tune_only=True)
    config = matmul_fused.partial_matmuls(pairs, signals, out_dtype=dtype, launch_as=tuning)
    tiles = matmul_fused.partial_tiles(config, rows, N)

    def gemm(partials, counts):
        with frozen("the fused reduce-scatter", agreement):
            matmul_fused.partial_matmuls(
                pairs,
                matmul_fused.Signals(counts, side.rank, world),
                out=partials,
                launch_as=Launch(agreement),
                programs=programs,
            )

    return side.run(pairs, out_dtype, bias, tiles, gemm)
