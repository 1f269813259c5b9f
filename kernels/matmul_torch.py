"""`fusedpar.kernels.matmul`'s contract in PyTorch: the torch implementation its tuner
may pick (one cuBLAS call where that computes the contract, else fp32 sums rounded once,
C's heads turned by `fusedpar.kernels.rope`'s formula), and the reference the tests hold
the kernel to. float64 operands (this implementation's alone) are summed in float64."""

import torch
from fusedpar.kernels.common import accumulator
from fusedpar.kernels.gated import gated_torch
from fusedpar.kernels.matmul_plan import GatedGrad
from fusedpar.kernels.rope import rope_torch


def cublas_computes(a, bias, c_dtype, accumulate, rope=None) -> bool:
    """Whether one cuBLAS call (`torch.mm` / `addmm`) computes `matmul`'s contract: C in
    A's dtype, nothing added into and no rotation, so the fp32 sum is rounded once, as
    the kernel does; and for 16-bit operands, no reduced-precision reduction (PyTorch
    allows cuBLAS to sum split-K partials in 16-bit by default: ``torch.backends.cuda.
    matmul.allow_bf16_reduced_precision_reduction = False``, or the fp16 flag, makes it
    exact)."""
    if accumulate or rope is not None or c_dtype != a.dtype:
        return False
    if bias is not None and bias.dtype != a.dtype:
        return False
    return a.dtype in (torch.float32, torch.float64) or not _reduced_precision_sums(a.dtype)


def _reduced_precision_sums(dtype: torch.dtype) -> bool:
    """Whether PyTorch lets cuBLAS sum 16-bit products in less than fp32 (split-K
    partials in 16-bit; for fp16 also accumulation in fp16)."""
    flags = torch.backends.cuda.matmul
    if dtype == torch.bfloat16:
        return bool(flags.allow_bf16_reduced_precision_reduction)
    try:
        fp16_accumulation = bool(flags.allow_fp16_accumulation)
    except AttributeError:  # older torch: no fp16 accumulation switch
        fp16_accumulation = False
    return bool(flags.allow_fp16_reduced_precision_reduction) or fp16_accumulation


def matmul_torch(a, b, bias, out, accumulate, rope=None, gated=None) -> None:
    """`matmul`'s contract in torch, into `out`. On CUDA, one cuBLAS call where that is
    the contract (`_cublas_computes`); elsewhere 16-bit operands are widened to fp32
    (their products are exact there) and summed in fp32, the bias, the rotation and an
    added C in fp32 too, and the result rounded once into `out`. A gated epilogue: C (up)
    or dh so, then the gated activation or its backward from it (`fusedpar.kernels.gated`).
    float64 operands: all of it in float64."""
    if isinstance(gated, GatedGrad):
        dh = torch.empty_like(out)
        matmul_torch(a, b, bias, dh, accumulate)
        gate, up, up_grad, hidden, activation = gated
        gated_torch(activation, gate, up, dh, hidden, out, up_grad)
        return
    if gated is not None:  # GatedProduct: C is up
        matmul_torch(a, b, bias, out, accumulate)
        gated_torch(gated.activation, gated.gate, out, None, gated.hidden, None, None)
        return
    if a.device.type == "cuda" and cublas_computes(a, bias, out.dtype, accumulate, rope):
        if bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, out=out)
        return
    wide = accumulator(a.dtype)
    c = a @ b if a.dtype == wide else a.to(wide) @ b.to(wide)
    if bias is not None:
        c = c + bias.to(wide)
    if rope is not None:  # c (M, N) as one sequence of M positions' heads, turned in place
        M, head_dim = c.shape[0], 2 * rope.cos.shape[1]
        heads = c.view(1, M, c.shape[1] // head_dim, head_dim)
        positions = (rope.first_row + torch.arange(M, device=c.device)) // rope.rows_per_position
        rope_torch(heads, rope.cos[positions], rope.sin[positions], False, heads)
    if accumulate:
        c = c + out.to(wide)
    out.copy_(c)


def gated_matmul_torch(a, b, b2, bias, bias2, activation):
    """`gated_matmul`'s contract in torch: `matmul`'s twice, then the gated activation
    from the rounded gate and up (`fusedpar.kernels.gated`)."""
    gate, up, h = (torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
                   for _ in range(3))  # fmt: skip
    matmul_torch(a, b, bias, gate, False)
    matmul_torch(a, b2, bias2, up, False)
    gated_torch(activation, gate, up, None, h, None, None)
    return gate, up, h


def matmul_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`matmul`'s contract in plain PyTorch, computed in A's dtype (float64 in -> the oracle).

    Returns a new tensor; ``out`` is read (for ``accumulate``), never written.
    """
    c = a @ b
    if bias is not None:
        c = c + bias.to(c.dtype)
    if accumulate:
        c = out.to(c.dtype) + c
    dtype = out.dtype if out is not None else out_dtype
    return c if dtype is None or c.dtype == torch.float64 else c.to(dtype)
