"""The fused schedule of `fusedpar.ops.linear`'s GEMMs (``overlap="fused"``): one
persistent GEMM launch per direction, fed and drained by `fusedpar.symmetric`.

| op side          | launches                                                        |
| ---------------- | --------------------------------------------------------------- |
| all-gather       | `gathered_matmuls` (1-3 weights each), waiting per tile on the  |
|                  | chunks the copy engine pulls                                    |
| reduce-scatter   | `partial_matmuls` (1-3 pairs, one SM left to the copy stream's  |
|                  | waits), then `sum_partials`                                     |

What the kernels do not take runs unfused, said once (`symmetric.say_once`): an
operand with an epilogue (a rotation, a gated MLP's) runs `matmul` over the gathered
rows once they are all there; float64, or more than 3 reduce-scatter pairs, run the
serial schedule.
"""

import torch
from torch import Tensor

from fusedpar import symmetric
from fusedpar.comm import all_gather_async, reduce_scatter_async, tuning_agreement
from fusedpar.kernels import matmul_fused
from fusedpar.kernels._common import accumulator, sm_count
from fusedpar.kernels._tuning import frozen
from fusedpar.kernels.matmul import matmul

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gather_matmuls_fused(x: Tensor, operands, biases, pg, gemm=matmul, epilogues=None,
                         side=None):  # fmt: skip
    """`fusedpar.ops.linear.gather_matmuls`'s result ([outs], gathered) by the fused
    schedule. `side` replaces the symmetric-memory `symmetric.Gather` (the benchmark's
    copy-engine stand-in, `bench.standin.CopyEngineGather`)."""
    epilogues = epilogues or [None] * len(operands)
    if x.dtype not in KERNEL_DTYPES:
        symmetric.say_once(f"overlap='fused': {x.dtype} runs the serial schedule")
        full = all_gather_async(x, pg).wait()
        return [gemm(full, op, bias=b, out_dtype=x.dtype) for op, b in zip(operands, biases,
                                                                            strict=True)], full
    if side is None:
        side = symmetric.transport(symmetric.Gather, pg, tuple(x.shape), x.dtype, x.device)
    plain = [i for i, e in enumerate(epilogues) if e is None]
    groups = [plain[i : i + matmul_fused.MAX_OPERANDS]
              for i in range(0, len(plain), matmul_fused.MAX_OPERANDS)]  # fmt: skip
    agreement = tuning_agreement(pg, x.device)
    full_shape = (side.world * x.shape[0], x.shape[1])
    scratch = x.new_empty(full_shape)
    flags = side.flags
    for group in groups:  # picked before any transfer, agreed over the group
        matmul_fused.gathered_matmuls(scratch, [operands[i] for i in group],
                                      [biases[i] for i in group], flags, side.rank, side.world,
                                      agreement=agreement, tune_only=True)  # fmt: skip
    outs: list = [None] * len(operands)
    wait_s = symmetric.wait_seconds()
    gathered = side.start(x)
    with frozen("the fused all-gather", agreement):
        for group in groups:
            made = matmul_fused.gathered_matmuls(
                gathered, [operands[i] for i in group], [biases[i] for i in group], flags,
                side.rank, side.world, status=side.status, wait_s=wait_s, agreement=agreement)
            for i, out in zip(group, made, strict=True):
                outs[i] = out
    side.finish()
    from fusedpar.ops.linear import _chunk_epilogue  # (linear imports this module)

    for i, epilogue in enumerate(epilogues):
        if epilogue is not None:
            symmetric.say_once("overlap='fused': a GEMM with an epilogue runs after the gather")
            outs[i] = gemm(gathered, operands[i], bias=biases[i], out_dtype=x.dtype,
                           **_chunk_epilogue(epilogue, slice(0, gathered.shape[0])))  # fmt: skip
    return outs, gathered


def matmuls_reduce_scatter_fused(pairs, pg, out_dtype, bias=None, reduce_dtype=None,
                                 side=None):  # fmt: skip
    """`fusedpar.ops.linear.matmuls_reduce_scatter`'s result by the fused schedule. `side`
    replaces `symmetric.Scatter` (`bench.standin.CopyEngineScatter`)."""
    A0 = pairs[0][0]
    wide = accumulator(A0.dtype)
    if A0.dtype not in KERNEL_DTYPES or len(pairs) > matmul_fused.MAX_OPERANDS:
        symmetric.say_once(f"overlap='fused': {A0.dtype} or {len(pairs)} pairs run serial")
        total = matmul(*pairs[0], out_dtype=wide)
        for A, B in pairs[1:]:
            matmul(A, B, out=total, accumulate=True)
        sent = total if reduce_dtype is None else total.to(reduce_dtype)
        mine = reduce_scatter_async(sent, pg).wait().to(wide)
        return (mine if bias is None else mine + bias.to(wide)).to(out_dtype)
    world = pg.size() if side is None else side.world
    rows, N = A0.shape[0] // world, pairs[0][1].shape[1]
    dtype = reduce_dtype or wide
    if side is None:
        side = symmetric.transport(symmetric.Scatter, pg, rows, N, dtype, A0.device)
    agreement = tuning_agreement(pg, A0.device)
    # one SM for the copy stream's waits (the interpreter's grid is the launcher's own)
    programs = sm_count(A0.device) - 1 if A0.is_cuda else None
    config = matmul_fused.partial_matmuls(pairs, side.counts, side.rank, world, out_dtype=dtype,
                                          agreement=agreement, tune_only=True)  # fmt: skip
    tiles = matmul_fused.partial_tiles(config, rows, N)

    def gemm(partials, counts):
        with frozen("the fused reduce-scatter", agreement):
            matmul_fused.partial_matmuls(pairs, counts, side.rank, world, out=partials,
                                         agreement=agreement, programs=programs)  # fmt: skip

    return side.run(pairs, out_dtype, bias, tiles, gemm)
