"""A dense gated MLP's GEMMs with its activation in their epilogues
(`fusedpar.kernels.matmul`'s kernel, `fusedpar.kernels.matmul_epilogue`'s epilogues).

| launcher            | computes                                                            |
| ------------------- | ------------------------------------------------------------------- |
| `gated_up_matmul`   | ``up = A Bu (+ bu)``, ``h = act(gate) * up`` (gate: stored, read)     |
| `gated_grad_matmul` | ``dh = dY Wd``; ``dgate = dh * up * act'(gate)``, ``dup = dh * act(gate)`` |
|                     | (and h again, for the down weight's gradient)                       |
| `gated_matmul`      | ``gate = A Bg (+ bg)``, ``up = A Bu (+ bu)``, ``h = act(gate) * up`` |

Each writes what the unfused launches would (`matmul`, then `fusedpar.kernels.gated`),
the same bits in the interpreter, with no elementwise pass of its own. The first two
keep the GEMM's K loop, TMA included, and grow only its epilogue (`matmul`'s ``gated=``:
`GatedProduct`, `GatedGrad`); the layers take them. `gated_matmul` feeds two
accumulators from each A tile and reads through pointers (fed from TMA, ptxas
serialized their wgmma); no layer takes it.
"""

import torch
from fusedpar.kernels import impl, tuning
from fusedpar.kernels.common import device_guard, ensure_tma_allocator, is_interpreted
from fusedpar.kernels.matmul import _arguments, _candidates, _matmul_kernel, _plan, matmul
from fusedpar.kernels.matmul_plan import GatedGrad, GatedProduct, check_gated, check_operands
from fusedpar.kernels.matmul_torch import cublas_computes, gated_matmul_torch
from fusedpar.kernels.tuning import bucket


def gated_matmul(a: torch.Tensor, b: torch.Tensor, b2: torch.Tensor, *,
                 bias: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
                 activation: str = "silu") -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(gate, up, h) (M, N) in A's dtype: ``gate = A @ B (+ bias)`` and ``up = A @ B2
    (+ bias2)``, each rounded once, and ``h = act(gate) * up`` from those rounded values
    (`fusedpar.kernels.gated`'s `ACTIVATIONS`), in one launch: every A tile feeds both
    products, and h costs no pass of its own. The same bits as `matmul` twice and
    `fusedpar.kernels.gated.gated` (the interpreter's; a GPU's may contract differently).
    B2 has B's shape, dtype and strides; the biases are both given or neither."""
    M, N = a.shape[0], b.shape[1] if b.dim() == 2 else 0
    if impl.runs_torch(a):
        check_operands(a, b, bias, None, False, None)
        check_gated(b, bias, b2, bias2, activation)
        return gated_matmul_torch(a, b, b2, bias, bias2, activation)
    plan = _plan(a, b, bias, None, False, None, False, None, (b2, bias2, activation))
    gate, up, h = (torch.empty((M, N), dtype=a.dtype, device=a.device) for _ in range(3))
    if M == 0 or N == 0:
        return gate, up, h
    if plan.meta["TMA"] or plan.meta["C_TMA"]:
        ensure_tma_allocator(a.device)
    args = _arguments(plan, a, b, bias, gate, None, 0, second=(b2, bias2, up, h))

    def launch(config):
        if isinstance(config, impl.Torch):
            results = gated_matmul_torch(a, b, b2, bias, bias2, activation)
            for out, result in zip((gate, up, h), results, strict=True):
                out.copy_(result)
            return
        grid, kwargs = plan.launch_arguments(config)
        _matmul_kernel[grid](*args, **kwargs)

    def candidates():
        tiles = _candidates(bucket(M), N, is_interpreted(_matmul_kernel), a.dtype, False,
                            gated="forward")  # fmt: skip
        cublas = cublas_computes(a, bias, a.dtype, False)
        return tiles + ([impl.TORCH] if cublas and impl.tunes_torch() else [])

    with device_guard(a):
        tuning.tuner("matmul").run(plan.key, candidates, launch, device=a.device)
    return gate, up, h


def gated_up_matmul(a: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, *,
                    bias: torch.Tensor | None = None, activation: str = "silu",
                    gemm=matmul) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(up, h) (M, N) in A's dtype: ``up = A @ B (+ bias)`` rounded once, and ``h =
    act(gate) * up`` from it and the gate projection's stored output `gate` (M, N), in one
    launch: what `matmul` then `fusedpar.kernels.gated.gated` return, with no pass of its
    own for h. The K loop is `matmul`'s (TMA included); only its epilogue reads the gate.
    `gemm`: `matmul`, or an op's `matmul_sequence.GemmSequence`.
    """
    M = a.shape[0] if a.dim() == 2 else 0
    N = b.shape[1] if b.dim() == 2 else 0
    up, h = (torch.empty((M, N), dtype=a.dtype, device=a.device) for _ in range(2))
    gemm(a, b, bias=bias, out=up, gated=GatedProduct(gate, h, activation))
    return up, h


def gated_grad_matmul(
    dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *,
    activation: str = "silu", hidden: bool = False, gemm=matmul,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``([dgate | dup], h)`` of a dense gated MLP's backward in one launch: ``dh = dy @
    w_down`` (rounded to dy's dtype, as `matmul` stores it) and from it and the forward's
    gate and up ``dgate = dh * up * act'(gate)``, ``dup = dh * act(gate)``, with `hidden`
    also ``h = act(gate) * up`` (else None): what `matmul` then
    `fusedpar.kernels.gated.gated_backward` with ``stacked=True`` return, with no pass of
    its own for dh.

    dy (M, d); w_down (d, N) (the down weight: read as it is stored); gate, up (M, N)
    with shared strides, all of dy's dtype. dgate and dup are one (M, 2N) view, so one
    GEMM takes both weights' gradients; h sits beside them in the same buffer. `gemm` as
    in `gated_up_matmul`."""
    M = dy.shape[0] if dy.dim() == 2 else 0
    N = w_down.shape[1] if w_down.dim() == 2 else 0
    buffer = torch.empty((M, (3 if hidden else 2) * N), dtype=dy.dtype, device=dy.device)
    dgate, dup, *h = buffer.chunk(3 if hidden else 2, 1)  # (one call: a third of 3 narrows)
    h = h[0] if hidden else None
    gemm(dy, w_down, out=dgate, gated=GatedGrad(gate, up, dup, h, activation))
    return buffer.narrow(1, 0, 2 * N), h
