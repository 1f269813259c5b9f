"""The numerics contract of DESIGN.md as assertions.

A result passes when ``max|out - ref| <= 2 * max|out_torch - ref| + floor``, where ``ref``
is the float64 oracle and ``out_torch`` the same math done by plain PyTorch in the op's
dtype (FlashAttention's "twice PyTorch's own error" rule). ``floor`` absorbs the cases
where PyTorch happens to be exact: a few units of the dtype's precision at the
reference's scale (``FLOOR[dtype] * max(1, max|ref|)``).

A float64 result against a float64 reference (a parallel model against its dense twin,
both in float64: `assert_ulps`) has no "PyTorch's own error" to scale by: it must agree to
a few units in the last place, ``max|out - ref| <= ulps * eps * max|ref|``.

In fp32 the rounding of a length-n dot grows like sqrt(n), and where an op amplifies it
(attention: exp of S, and dP - delta) a fixed floor is too tight for long dots: such an
op passes its dot length as `sum_length`, and the fp32 floor grows as
sqrt(sum_length / FLOOR_SUM_LENGTH). fp16 and bf16 floors are far above this effect
and do not grow.
"""

import math

import torch

# About 8 ulps at magnitude 1: a different summation order alone can cost this much.
FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
# The dot length FLOOR is set for. Measured over 2,000 random fp32 flash-attention
# examples (head dims 8 to 256, the dot length D), against the worse of PyTorch's two
# routes (see tests/attention/test_attention.py): the gradients' error past twice PyTorch's
# reached 1.7e-7 * sqrt(D) * max(1, max|ref|); this floor allows 2.5e-7 * sqrt(D).
FLOOR_SUM_LENGTH = 16


def floor(dtype: torch.dtype, sum_length: int | None = None) -> float:
    """The floor of the rule for `dtype` at magnitude 1; in fp32, for dots of `sum_length`."""
    fp32_dot = sum_length and dtype == torch.float32
    growth = math.sqrt(sum_length / FLOOR_SUM_LENGTH) if fp32_dot else 1.0
    return FLOOR[dtype] * max(1.0, growth)


def tolerance(
    ref: torch.Tensor, out_torch: torch.Tensor, dtype: torch.dtype, sum_length: int | None = None
) -> float:
    """The largest error the contract allows for an op of `dtype` against `ref`."""
    ref, out_torch = ref.double(), out_torch.double()
    # Where PyTorch itself overflowed (fp16 past 65504), its error says nothing: measure
    # it only where both it and the reference are finite.
    finite = torch.isfinite(ref) & torch.isfinite(out_torch)
    if not finite.any():
        return floor(dtype, sum_length)
    torch_err = (out_torch[finite] - ref[finite]).abs().max().item()
    scale = max(1.0, ref[torch.isfinite(ref)].abs().max().item())
    return 2 * torch_err + floor(dtype, sum_length) * scale


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    out_torch: torch.Tensor,
    *,
    name: str = "output",
    sum_length: int | None = None,
) -> None:
    """Assert the tolerance rule for `out` (any float dtype) against the float64 `ref`;
    `sum_length`: the length of the fp32 dots whose rounding the op amplifies."""
    dtype = out.dtype
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    out, ref = out.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        bad = (torch.isfinite(out) != finite).sum().item()
        raise AssertionError(f"{name}: non-finite values differ from the reference at {bad} places")
    err = (out[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    allowed = tolerance(ref, out_torch, dtype, sum_length)
    if not err <= allowed:
        raise AssertionError(
            f"{name}: max error {err:.3g} > allowed {allowed:.3g} "
            f"(2 x PyTorch's {dtype} error + floor), shape {tuple(out.shape)}"
        )


def assert_ulps(
    out: torch.Tensor, ref: torch.Tensor, *, ulps: float = 16, name: str = "output"
) -> None:
    """Assert ``max|out - ref| <= ulps * eps * max|ref|`` (eps of out's dtype: 2.2e-16 in
    float64), non-finite values equal: for a float64 result against a float64 reference
    of the same math (a parallel model against its dense twin), where the only
    difference may be the order of rounded sums."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise AssertionError(
            f"{name}: {out.dtype} {tuple(out.shape)} against the reference's "
            f"{ref.dtype} {tuple(ref.shape)}"
        )
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), finite) or not torch.equal(out[~finite], ref[~finite]):
        bad = (torch.isfinite(out) != finite).sum().item()
        raise AssertionError(f"{name}: non-finite values differ from the reference at {bad} places")
    if not finite.any():
        return
    err = (out[finite] - ref[finite]).abs().max().item()
    unit = torch.finfo(out.dtype).eps * ref[finite].abs().max().item()
    if not err <= ulps * unit:
        raise AssertionError(
            f"{name}: max error {err:.3g} is {err / unit:.1f} ulps of max|ref|, "
            f"over the {ulps} allowed, shape {tuple(out.shape)}"
        )
