"""The gated activation of a dense SwiGLU or GeGLU MLP, one elementwise pass each way.

gate, up, h (..., N) share a shape; ``act`` is `ACTIVATIONS`' (computed in fp32, each
output rounded once):

| function         | reads        | writes        | computes                                     |
| ---------------- | ------------ | ------------- | -------------------------------------------- |
| `gated`          | gate, up     | h             | ``h = act(gate) * up``                       |
| `gated_backward` | gate, up, dh | dgate, dup    | ``dgate = dh * up * act'(gate)``,            |
|                  |              | (and h)       | ``dup = dh * act(gate)`` (and h again)       |

So a layer saves gate and up, never act(gate) nor h. Where they can, the layers take these
formulas inside GEMM epilogues (`fusedpar.kernels.matmul_gated`); `gated` is the
tensor-parallel forward's h after the all-gather ring (`fusedpar.ops.gated_down`), and
`gated_backward` the same gradients apart from any GEMM (the unfused baseline, and the
tests' bit-for-bit twin of the epilogue). The torch implementation (timed against the
fixed tile on CUDA under ``auto``) and the float64 reference close the file. Who calls
which, and the MoE experts' own activation: docs/elementwise.md.
"""

import math

import torch
import triton
import triton.language as tl
from fusedpar.kernels import common, impl, tuning
from fusedpar.kernels.common import cdiv, check_float_dtype, is_interpreted, next_power_of_2
from fusedpar.kernels.tuning import bucket

# silu(g) = g sigmoid(g); gelu: the erf form; gelu_tanh: its tanh approximation (Gemma).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# Elements a program holds per tensor: 16 per thread at 8 warps, as a bandwidth-bound
# row kernel wants (the backward keeps gate, up, dh and three results live).
TILE_ELEMENTS = 4096


def tile(N: int, interpreted: bool) -> dict:
    """Rows x columns of a program and its warps. The interpreter runs programs one at a
    time: 2 x 16 tiles, so tiny shapes cross row and column blocks."""
    if interpreted:
        return dict(BLOCK_M=2, BLOCK_N=16, num_warps=4)
    block_n = min(1024, next_power_of_2(max(N, 1)))
    return dict(BLOCK_M=max(1, TILE_ELEMENTS // block_n), BLOCK_N=block_n, num_warps=8)


@triton.jit
def _tanh_terms(x):
    """``(1 + tanh x, 1 - tanh^2 x)`` in fp32 with no cancellation: from e = exp(-2|x|),
    ``1 + tanh x`` is 2 / (1 + e) for x >= 0 and 2e / (1 + e) below, ``1 - tanh^2 x`` is
    4e / (1 + e)^2; near 0 a series for tanh (e would lose x's relative precision). Forming
    them from tanh lost up to ~2e-5 of their relative precision where |tanh x| nears 1,
    which put a gelu_tanh weight gradient over the fp32 tolerance (CI's draw: T=3, d=1,
    h=17)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    r = 1.0 / (1.0 + e)
    small = a < 0.1
    xs = tl.where(small, x, 0.0)  # (the series of a large x would overflow, unused)
    x2 = xs * xs
    t = xs * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    one_plus = tl.where(small, 1.0 + t, tl.where(x < 0, 2.0 * e * r, 2.0 * r))
    sech2 = tl.where(small, 1.0 - t * t, 4.0 * e * r * r)
    return one_plus, sech2


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """``(act(g), act'(g))`` in fp32."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        a = g * s
        slope = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))  # 1 / sqrt(2)
        a = g * cdf
        slope = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1 / sqrt(2 pi)
    else:  # gelu_tanh: 0.5 g (1 + tanh(k (g + c g^3))), k = sqrt(2 / pi), c = 0.044715
        one_plus, sech2 = _tanh_terms(0.7978845608028654 * (g + 0.044715 * g * g * g))
        a = 0.5 * g * one_plus
        slope = 0.5 * one_plus + 0.5 * g * sech2 * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, slope


@triton.jit
def _gated_kernel(
    # pointers
    g_ptr, u_ptr, dh_ptr, h_ptr, dg_ptr, du_ptr,
    # strides (rows, columns) of each
    stride_gm, stride_gn, stride_um, stride_un, stride_dhm, stride_dhn,
    stride_hm, stride_hn, stride_dgm, stride_dgn, stride_dum, stride_dun,
    # sizes
    M, N,
    # meta-parameters
    ACTIVATION: tl.constexpr, BACKWARD: tl.constexpr, STORE_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile: with STORE_H h = act(g) * u, with BACKWARD dgate and
    dup from dh (the module doc's table). The pointers a mode does not use are never
    read."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]
    mask = (rows < M) & (cols < N)
    g = tl.load(g_ptr + rows * stride_gm + cols * stride_gn, mask=mask, other=0.0)
    u = tl.load(u_ptr + rows * stride_um + cols * stride_un, mask=mask, other=0.0)
    a, slope = _activation(g.to(tl.float32), ACTIVATION)
    u = u.to(tl.float32)
    if STORE_H:
        tl.store(h_ptr + rows * stride_hm + cols * stride_hn, (a * u).to(h_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    if BACKWARD:
        dh = tl.load(dh_ptr + rows * stride_dhm + cols * stride_dhn, mask=mask, other=0.0)
        dh = dh.to(tl.float32)
        tl.store(du_ptr + rows * stride_dum + cols * stride_dun,
                 (dh * a).to(du_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        tl.store(dg_ptr + rows * stride_dgm + cols * stride_dgn,
                 (dh * u * slope).to(dg_ptr.dtype.element_ty), mask=mask)  # fmt: skip


# --- launchers -------------------------------------------------------------------------


def check_gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """ValueError/TypeError naming the sizes for inputs the kernel cannot take."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must share a shape")
    check_float_dtype("gate", gate)
    if up.dtype != gate.dtype or up.device != gate.device:
        raise TypeError(f"gate is {gate.dtype} on {gate.device}, up {up.dtype} on {up.device}")


# (layouts, dtype, device, activation, what is written) -> (tile, grid, tuner key)
_PLANS: dict[tuple, tuple] = {}


def _launch(activation: str, g, u, dh, h, dg, du) -> None:
    """The kernel over (M, N) views writing h (if given) and, from dh (if given), dg and
    du; or under ``FUSEDPAR_IMPL=auto`` on CUDA whichever of its tile and the torch
    implementation the tuner measured faster. Its tile, grid and key are worked out once
    per call signature."""
    M, N = g.shape
    if M * N == 0:
        return
    backward, store_h = dh is not None, h is not None
    # the pointers a mode does not use: any tensor of the call (never read or written)
    dh_, h_, dg_, du_ = (t if t is not None else g for t in (dh, h, dg, du))
    signature = (g.shape, g.stride(), u.stride(), dh_.stride(), h_.stride(), dg_.stride(),
                 du_.stride(), g.dtype, g.device, activation, backward, store_h)  # fmt: skip
    plan = _PLANS.get(signature)
    if plan is None:
        config = tile(N, is_interpreted(_gated_kernel))
        grid = (cdiv(M, config["BLOCK_M"]), cdiv(N, config["BLOCK_N"]))
        if len(_PLANS) >= 4096:  # a property test's many shapes: start over
            _PLANS.clear()
        key = (bucket(M), N, str(g.dtype), activation, backward, store_h)
        scalars = (*signature[1], *signature[2], *signature[3], *signature[4], *signature[5],
                   *signature[6], M, N)  # the six strides, then the sizes  # fmt: skip
        meta = {"ACTIVATION": activation, "BACKWARD": backward, "STORE_H": store_h}
        plan = _PLANS[signature] = (config, grid, key, scalars, meta)
    config, grid, key, scalars, meta = plan

    def torch_run():
        gated_torch(activation, g, u, dh, h, dg, du)

    tuning.run_tile_or_torch(_gated_kernel, config, lambda _: grid,
                              (g, u, dh_, h_, dg_, du_, *scalars), meta, key, g,
                              torch_run)  # fmt: skip


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in gate's shape and dtype, computed in fp32, rounded once.
    gate, up (..., N): any float dtype (the same), any strides."""
    check_gated(gate, up, activation)
    g, u = _rows(gate), _rows(up)
    h = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    run = gated_torch if impl.runs_torch(gate) else _launch
    run(activation, g, u, None, h, None, None)
    return h if gate.dim() == 2 else h.view(gate.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(M, N) rows of `t` (..., N): itself when 2-D (a view costs ~1 µs of host time)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def gated_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   activation: str = "silu", *, hidden: bool = False,
                   stacked: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``(dgate, dup)`` of `gated` from dh (gate's shape), each in gate's dtype; with
    `hidden` ``(dgate, dup, h)``, h again from the same pass. With `stacked` (gate 2-D
    (M, N)) ``([dgate | dup],)`` or ``([dgate | dup], h)``: both in one (M, 2N) tensor,
    so one GEMM takes both weights' gradients."""
    check_gated(gate, up, activation)
    if dh.shape != gate.shape:
        raise ValueError(f"dh {tuple(dh.shape)} must be gate's shape {tuple(gate.shape)}")
    N = gate.shape[-1]
    g, u, d = _rows(gate), _rows(up), _rows(dh)
    if stacked:
        if gate.dim() != 2:
            raise ValueError(f"gated_backward: stacked takes 2-D gate, got {tuple(gate.shape)}")
        both = torch.empty((g.shape[0], 2 * N), dtype=gate.dtype, device=gate.device)
        dg, du = both[:, :N], both[:, N:]
    else:
        dg, du = (torch.empty(g.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    h = torch.empty(g.shape, dtype=gate.dtype, device=gate.device) if hidden else None
    run = gated_torch if impl.runs_torch(gate) else _launch
    run(activation, g, u, d, h, dg, du)
    if stacked:
        return (both,) if h is None else (both, h)
    outputs = (dg, du) if h is None else (dg, du, h)
    return outputs if gate.dim() == 2 else tuple(t.view(gate.shape) for t in outputs)


# --- torch implementation and reference ------------------------------------------------


def _activation_torch(activation: str, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(g), act'(g))`` as `_activation` computes them (g in fp32 or float64)."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return g * s, s * (1 + g * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (g + 0.044715 * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)


def gated_torch(activation: str, g, u, dh, h, dg, du) -> None:
    """The kernel's contract in PyTorch, into h (if given) and, from dh, dg and du: fp32
    inside, each result rounded once."""
    wide = common.accumulator(g.dtype)
    a, slope = _activation_torch(activation, g.to(wide))
    uf = u.to(wide)
    if h is not None:
        h.copy_(a * uf)
    if dh is not None:
        dhf = dh.to(wide)
        dg.copy_(dhf * uf * slope)
        du.copy_(dhf * a)


def gated_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"):
    """``act(gate) * up`` with PyTorch's own activation, in gate's dtype (float64 in: the
    oracle), differentiable by autograd."""
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return getattr(torch.nn.functional, activation)(gate) * up
