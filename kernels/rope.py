"""Rotary position embeddings, forward and backward: one row kernel, fp32 inside.

x (B, S, H, hd) any strides; cos, sin (S, r/2) fp32 with r <= hd the rotated dims
(r < hd: partial rotary, GPT-NeoX: the last hd - r dims pass); x1, x2 = x[..., :r/2],
x[..., r/2:r]:

| call                     | computes                                                |
| ------------------------ | ------------------------------------------------------- |
| `rope(x, cos, sin)`      | ``(x1 cos - x2 sin, x2 cos + x1 sin, x[..., r:])``      |
| `rope(dy, cos, sin,`     | the backward, the rotation's transpose: ``(dy1 cos +``  |
| ``inverse=True)``        | ``dy2 sin, dy2 cos - dy1 sin, dy[..., r:])``            |

Each result is rounded once to x's dtype, in a new contiguous (B, S, H, hd) tensor (or
into given ones of x's shape, which may be the inputs themselves: in place). One
program rotates every head of BLOCK_H at one position: cos and sin are loaded once per
position, where the PyTorch formula is a dozen elementwise kernels each way (slices,
casts, four products, a concatenation). On CUDA under ``FUSEDPAR_IMPL=auto`` the tuner
times the kernel's fixed tile against the torch implementation, which closes the file.
"""

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.common import cdiv, check_float_dtype, is_interpreted, next_power_of_2
from fusedpar.kernels.tuning import bucket

# Elements of each half a program rotates (heads x r/2): 32 heads of 64 at Llama's
# head dim, 16 per thread at 4 warps.
TILE_ELEMENTS = 2048


def tile(heads: int, half: int, rest: int, interpreted: bool) -> dict:
    """Heads per program, the blocks of a half and of the passing dims, and warps. The
    interpreter runs programs one at a time: 2 heads a program, so tiny shapes cross head
    blocks."""
    block_half, block_rest = next_power_of_2(max(half, 1)), next_power_of_2(rest) if rest else 0
    if interpreted:
        return dict(BLOCK_H=2, BLOCK_HALF=block_half, BLOCK_REST=block_rest, num_warps=4)
    block_h = max(1, min(next_power_of_2(heads), TILE_ELEMENTS // block_half))
    return dict(BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=block_rest, num_warps=4)


@triton.jit
def _rope_kernel(
    # pointers (x2, y2: the second tensor of a pair)
    x_ptr, cos_ptr, sin_ptr, y_ptr, x2_ptr, y2_ptr,
    # strides
    stride_xb, stride_xs, stride_xh, stride_xd, stride_yb, stride_ys, stride_yh, stride_yd,
    stride_cs, stride_cd, stride_ss, stride_sd,
    stride_x2b, stride_x2s, stride_x2h, stride_x2d,
    stride_y2b, stride_y2s, stride_y2h, stride_y2d,
    # sizes
    S, H, H2, HALF, HEAD_DIM,
    # meta-parameters
    INVERSE: tl.constexpr, PAIR: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    """Heads [pid_h * BLOCK_H, ...) of position (b, s) = divmod(pid_row, S): the rotation
    (by -angle with INVERSE) of their first 2 * HALF dims, the rest copied. With PAIR the
    head blocks past x's are the second tensor's (q and k in one launch)."""
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    block = tl.program_id(1)
    x_row = x_ptr + b * stride_xb + s * stride_xs
    y_row = y_ptr + b * stride_yb + s * stride_ys
    heads_here, sxh, sxd, syh, syd = H, stride_xh, stride_xd, stride_yh, stride_yd
    if PAIR:
        first_blocks = tl.cdiv(H, BLOCK_H)
        if block >= first_blocks:
            block -= first_blocks
            x_row = x2_ptr + b * stride_x2b + s * stride_x2s
            y_row = y2_ptr + b * stride_y2b + s * stride_y2s
            heads_here, sxh, sxd, syh, syd = H2, stride_x2h, stride_x2d, stride_y2h, stride_y2d
    heads = (block * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + s * stride_cs + i * stride_cd, mask=i < HALF, other=0.0)[None, :]
    sn = tl.load(sin_ptr + s * stride_ss + i * stride_sd, mask=i < HALF, other=0.0)[None, :]
    if INVERSE:
        sn = -sn
    x_row += heads * sxh
    y_row += heads * syh
    mask = (heads < heads_here) & (i < HALF)[None, :]
    x1 = tl.load(x_row + i[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (i + HALF)[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_row + i[None, :] * syd, (x1 * c - x2 * sn).to(out_ty), mask=mask)
    tl.store(y_row + (i + HALF)[None, :] * syd, (x2 * c + x1 * sn).to(out_ty), mask=mask)
    if BLOCK_REST > 0:  # partial rotary: the dims past 2 * HALF pass
        j = 2 * HALF + tl.arange(0, BLOCK_REST)
        rest = (heads < heads_here) & (j < HEAD_DIM)[None, :]
        passing = tl.load(x_row + j[None, :] * sxd, mask=rest, other=0.0)
        tl.store(y_row + j[None, :] * syd, passing, mask=rest)


# --- launcher ---------------------------------------------------------------------------


def check_tables(who: str, cos, sin, positions: int, width: int, device, dtype) -> None:
    """ValueError/TypeError naming the sizes unless cos and sin are (positions, r/2)
    float32 on `device` with r <= width, the head dim (the features of a row they turn:
    this kernel's and `fusedpar.kernels.rms_norm`'s ``rope=``). float64 x (torch's
    implementation only) takes float64 tables and rotates in float64 (the tables' dtype
    is ``accumulator(x.dtype)``, `fusedpar.kernels.common`): a float64 model's rotation
    is not rounded through fp32 angles."""
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != positions:
        raise ValueError(f"{who}: cos and sin must be (S={positions}, r/2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    if 2 * cos.shape[1] > width:
        raise ValueError(f"{who}: {2 * cos.shape[1]} rotated dims, over the head dim {width}")
    wide = common.accumulator(dtype)
    if cos.dtype != wide or sin.dtype != wide:
        raise TypeError(f"{who}: cos and sin must be {str(wide).removeprefix('torch.')} for "
                        f"{dtype} x, got {cos.dtype} and {sin.dtype}")  # fmt: skip
    if not device == cos.device == sin.device:
        raise ValueError(f"{who}: x, cos, sin on {device}, {cos.device}, {sin.device}")


def check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError/TypeError naming the sizes for inputs the kernel cannot take."""
    if x.dim() != 4:
        raise ValueError(f"rope: x must be (B, S, H, hd), got {tuple(x.shape)}")
    check_float_dtype("x", x)
    check_tables("rope", cos, sin, x.shape[1], x.shape[3], x.device, x.dtype)


# (shapes, strides, dtype, device, direction) -> (tile, grid, tuner key)
_PLANS: dict[tuple, tuple] = {}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: torch.Tensor | None = None):  # fmt: skip
    """The rotation of x (the module doc's table) into a new (B, S, H, hd) tensor of x's
    dtype, or into `out` (x's shape and dtype, any strides; x itself: in place);
    ``inverse``: by -angle, the backward. Checked and planned once per call signature."""
    return _rotate([x], cos, sin, inverse, None if out is None else [out])[0]


def rope_pair(x, x2, cos, sin, inverse: bool = False, outs=None):
    """`rope` of two tensors at the same positions in one launch (q and k: their heads
    may differ in number and strides; B, S, hd and the dtype must match), into `outs`
    (a pair, as `rope`'s `out`) if given."""
    return tuple(_rotate([x, x2], cos, sin, inverse, outs))


def _check_pair(x, x2) -> None:
    B, S, _, hd = x.shape
    if x2.dim() != 4 or (x2.shape[0], x2.shape[1], x2.shape[3]) != (B, S, hd):
        raise ValueError(f"rope_pair: the second tensor must be ({B}, {S}, H2, {hd}) as the "
                         f"first {tuple(x.shape)}, got {tuple(x2.shape)}")  # fmt: skip
    if x2.dtype != x.dtype or x2.device != x.device:
        raise ValueError(f"rope_pair: both tensors one dtype and device, got {x.dtype} on "
                         f"{x.device} and {x2.dtype} on {x2.device}")  # fmt: skip


def _check_outs(xs, outs) -> None:
    for x, y in zip(xs, outs, strict=True):
        if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
            raise ValueError(f"rope: out must be {tuple(x.shape)} {x.dtype} on {x.device} "
                             f"as its input, got {tuple(y.shape)} {y.dtype} on "
                             f"{y.device}")  # fmt: skip


def _rotate(xs: list, cos, sin, inverse: bool, outs=None) -> list:
    given = outs is not None and tuple((y.shape, y.dtype, y.device) for y in outs)
    signature = (*((x.shape, x.stride(), x.dtype, x.device) for x in xs), cos.shape,
                 cos.stride(), cos.dtype, cos.device, sin.stride(), sin.dtype, sin.device,
                 inverse, given)  # fmt: skip
    plan = _PLANS.get(signature)
    if plan is None:
        check_rope(xs[0], cos, sin)
        if len(xs) == 2:
            _check_pair(*xs)
        if outs is not None:
            _check_outs(xs, outs)
        B, S, H, hd = xs[0].shape
        heads = [x.shape[2] for x in xs]
        half = cos.shape[1]
        config = tile(max(heads), half, hd - 2 * half, is_interpreted(_rope_kernel))
        grid = (B * S, sum(cdiv(h, config["BLOCK_H"]) for h in heads))
        if len(_PLANS) >= 4096:  # a property test's many shapes: start over
            _PLANS.clear()
        key = (bucket(B * S), *heads, half, hd, str(xs[0].dtype), inverse)
        plan = _PLANS[signature] = (config, grid, key)
    ys = (
        [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
        if outs is None
        else list(outs)
    )
    if impl.runs_torch(xs[0]):
        for x, y in zip(xs, ys, strict=True):
            rope_torch(x, cos, sin, inverse, y)
        return ys
    config, grid, key = plan
    if grid[0] * grid[1] == 0 or ys[0].shape[3] == 0:
        return ys
    x, y = xs[0], ys[0]
    x2, y2 = (xs[1], ys[1]) if len(xs) == 2 else (x, y)  # (a single tensor: not read)
    args = (x, cos, sin, y, x2, y2, *x.stride(), *y.stride(), *cos.stride(), *sin.stride(),
            *x2.stride(), *y2.stride(), x.shape[1], x.shape[2], x2.shape[2], cos.shape[1],
            x.shape[3])  # fmt: skip

    def run_torch():
        for x_i, y_i in zip(xs, ys, strict=True):
            rope_torch(x_i, cos, sin, inverse, y_i)

    tuning.run_tile_or_torch(_rope_kernel, config, lambda _: grid, args,
                              {"INVERSE": inverse, "PAIR": len(xs) == 2}, key, x,
                              run_torch)  # fmt: skip
    return ys


# --- torch implementation --------------------------------------------------------------


def rope_torch(x, cos, sin, inverse: bool, out: torch.Tensor) -> None:
    """`rope`'s contract in PyTorch, into `out` (x itself: in place): fp32 inside (float64
    for float64 x: the tables' dtype, `check_tables`), rounded once."""
    half, wide = cos.shape[-1], common.accumulator(x.dtype)
    x1, x2 = x[..., :half].to(wide), x[..., half : 2 * half].to(wide)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if inverse:
        s = -s
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s  # both before either is written
    out[..., :half] = y1
    out[..., half : 2 * half] = y2
    if out.data_ptr() != x.data_ptr():
        out[..., 2 * half :] = x[..., 2 * half :]
