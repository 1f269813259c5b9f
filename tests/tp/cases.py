"""The tensor-parallel family: its opcheck cases (`opcheck_cases`; tests/test_compile.py
runs them)."""

import torch
import torch.distributed as dist

from fusedpar.nn.attention_parts import rope_tables
from fusedpar.ops.linear import GatherOptions
from tests.support.opcheck import leaf

# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def opcheck_cases(group: str) -> list:
    """(op, args) for the custom ops of the TP linears: all-gather then matmul, matmul then
    reduce-scatter, and their backwards: small and random, float inputs requiring grad
    (the autograd registration is exercised); `group`: the ranks'."""
    ops = torch.ops.fusedpar
    W = dist.get_world_size()
    xt = leaf(3, 4, 8).transpose(0, 1)  # (4, 3, 8), strided
    x, w1, w2, b1 = leaf(4, 3, 8), leaf(6, 8), leaf(5, 8), leaf(6)
    wr = leaf(8, 8)  # a head of 8 turned by RoPE
    tables8, tables6 = (list(rope_tables(torch.arange(4 * W), hd, 100.0)) for hd in (8, 6))
    y = torch.randn(4 * W, 3, 6)

    def gather(chunks, rotate, head_dim=0, save=False):  # the forward's options
        return GatherOptions(chunks, head_dim, rotate, save_gathered=save).ints()

    def grads(chunks, rotate, needs_w, needs_b, head_dim=0):  # the backward's
        return GatherOptions(chunks, head_dim, rotate, False, True, needs_w, needs_b).ints()

    return [
        (ops.all_gather_matmul, (xt, [w1], [b1], [True], group, gather(1, [0], save=1), [], None)),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 6)],
                xt,
                None,
                [w1],
                group,
                grads(1, [0], [1], [1]),
                [],
                None,
            ),
        ),
        (
            ops.matmul_reduce_scatter_backward,
            (
                torch.randn(4, 3, 8),
                y.transpose(0, 1).contiguous().transpose(0, 1),
                torch.randn(8, 6),
                group,
                1,
                True,
                True,
                True,
            ),
        ),
        (
            ops.all_gather_matmul,
            (x, [w1, w2], [b1], [True, False], group, gather(2, [0, 0]), [], None),
        ),
        (ops.all_gather_matmul, (x, [w1], [], [False], group, gather(1, [0], save=1), [], None)),
        # RoPE: heads of 8 in the GEMM's epilogue; of 6 (not a power of 2) after the ring
        (
            ops.all_gather_matmul,
            (
                x,
                [wr, w1],
                [b1],
                [False, True],
                group,
                gather(0, [1, 0], head_dim=8),
                tables8,
                torch.bfloat16,
            ),  # serial (chunks 0), dX's partials in bf16
        ),
        (
            ops.all_gather_matmul,
            (xt, [w1], [b1], [True], group, gather(1, [1], head_dim=6, save=1), tables6, None),
        ),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 6)],
                x,
                None,
                [w1],
                group,
                grads(1, [0], [1], [0]),
                [],
                torch.float16,
            ),
        ),
        (
            ops.all_gather_matmul_backward,
            (
                [torch.randn(4 * W, 3, 8)],
                x,
                None,
                [wr],
                group,
                grads(1, [1], [1], [0], head_dim=8),
                tables8,
                None,
            ),
        ),
        (
            ops.matmul_reduce_scatter,
            (leaf(4 * W, 3, 6), leaf(8, 6), leaf(8), group, 1, torch.float16),
        ),
        (
            ops.matmul_reduce_scatter_backward,
            (torch.randn(4, 3, 8), y, torch.randn(8, 6), group, 1, True, True, True),
        ),
    ]
