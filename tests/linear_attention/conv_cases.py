"""The short convolution's cases (`fusedpar.kernels.linear_attention.conv1d`): its
compile-gate cases (`GATE_CASES`; tests/test_compile_gate.py builds them) and its opcheck
cases (`conv_opcheck_cases`, also as `opcheck_cases`; tests/test_compile.py runs them)."""

import torch
from fusedpar.kernels.linear_attention import conv1d

from tests.support.gate import Cases, _empty
from tests.support.opcheck import leaf

GATE_CASES = Cases()

# --- compile-gate scenario: the launchers called as the library calls them -------------


def conv1d_calls(dtype, states):
    """The conv forward and backward at Qwen3.5-35B's q|k|v width (8192 channels, kernel
    4): two sequences of 256 tokens without states (a training step's), or, with
    `states`, two packed documents with bias, initial states in and final states out
    (every flag of the kernels: the context-parallel halo's case)."""
    C, W = 8192, 4
    x, weight = (
        _empty((1 if states else 2, 512 if states else 256, C), dtype),
        _empty((C, W), dtype),
    )
    bias = _empty((C,), dtype) if states else None
    cu = torch.tensor([0, 100, 512], dtype=torch.int32) if states else None
    init = _empty((2, C, W - 1), dtype) if states else None
    _, final = conv1d.causal_conv1d(x, weight, bias, "silu", cu, init, states)
    dfinal = _empty(final.shape, dtype) if states else None
    conv1d.causal_conv1d_backward(_empty(x.shape, dtype), dfinal, x, weight, bias, "silu", cu, init)


# --- compile-gate cases ---

# Each kernel's fixed tile, 16-bit (no spill allowed, and on an A100) and fp32 (reported),
# without states and with all of them; the edge kernel in each direction.
KERNELS = (
    ("fwd", "_conv1d_fwd_kernel", None),
    ("bwd", "_conv1d_bwd_kernel", None),
    ("final", "_conv1d_edge_kernel", {"BACKWARD": False}),
    ("dinitial", "_conv1d_edge_kernel", {"BACKWARD": True}),
)
for part, kernel, match in KERNELS:
    for states in (False, True):
        if part in ("final", "dinitial") and not states:
            continue  # launched only with states
        for dtype, cap in (("bfloat16", 90), ("bfloat16", 80), ("float32", 90)):
            GATE_CASES.add(
                f"conv1d-{part}",
                f"{dtype}-w4" + ("-states" if states else ""),
                conv1d_calls,
                {"dtype": dtype, "states": states},
                kernel,
                cap,
                no_spill=dtype == "bfloat16",
                match=match,
            )


# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def conv_opcheck_cases(group: str) -> list:
    """(op, args) for the conv's custom ops: small and random, strided, packed with
    states, some gradients not asked for; float inputs require grad. `group`: the
    context-parallel halo's (`fusedpar.ops.conv_halo`), run on every rank."""
    ops = torch.ops.fusedpar
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    xt = leaf(2, 5, 6).transpose(1, 2)  # (2, 6, 5), strided
    return [
        (ops.causal_conv1d, (xt, leaf(5, 4), None, "silu", None, None, False)),
        (ops.causal_conv1d, (leaf(1, 7, 3), leaf(3, 3), leaf(3), "none", cu, leaf(3, 3, 2), True)),
        (
            ops.causal_conv1d,
            (
                leaf(2, 3, 4, dtype=torch.float16),
                leaf(4, 4, dtype=torch.float16),
                None,
                "silu",
                None,
                leaf(2, 4, 3, dtype=torch.float16),
                True,
            ),
        ),
        (
            ops.causal_conv1d_backward,
            (
                torch.randn(2, 6, 5),
                None,
                xt,
                leaf(5, 4),
                None,
                "silu",
                None,
                None,
                [True, True, False, False],
            ),
        ),
        (
            ops.causal_conv1d_backward,
            (
                torch.randn(1, 7, 3),
                torch.randn(3, 3, 2),
                leaf(1, 7, 3),
                leaf(3, 3),
                leaf(3),
                "none",
                cu,
                leaf(3, 3, 2),
                [False, True, True, True],
            ),
        ),
        # the halo: zigzag, spans of 2 tokens and W - 1 = 3 (two spans' tokens), contiguous
        (ops.conv_halo, (leaf(2, 4, 3), group, "", "zigzag", 3)),
        (ops.conv_halo, (leaf(1, 5, 2, dtype=torch.float64), group, "", "contiguous", 1)),
        (ops.conv_halo_backward, (torch.randn(2, 6, 3), group, "", "zigzag", 4)),
    ]


opcheck_cases = conv_opcheck_cases
