"""The row- and element-wise kernels' cases (RMSNorm, the gated activation, RoPE):
their compile-gate cases (`GATE_CASES`; tests/test_compile_gate.py builds them) and
their scenarios."""

import torch
import torch.distributed as dist
from fusedpar.kernels import (
    gated,
    rms_norm,
    rope,
)

from fusedpar.nn.attention_parts import rope_tables
from tests.support.gate import Cases, _empty
from tests.support.opcheck import leaf

GATE_CASES = Cases()
add, add_configs = GATE_CASES.add, GATE_CASES.add_configs

# --- compile-gate scenarios: the launchers called as the library calls them (see
# tests/support/gate.py) ---


def rms_norm_calls(dtype, dim, rotary=0):
    """RMSNorm's forward and backward over 256 rows of `dim` features; with `rotary`, a
    q/k head norm whose kernel turns that many dims by RoPE (32 positions of 8 heads)."""
    x, weight = _empty((256, dim), dtype), _empty((dim,), dtype)
    rope = None
    if rotary:
        x = x.view(32, 8, dim)
        rope = tuple(_empty((32, rotary // 2), "float32") for _ in range(2))
    _, rstd = rms_norm.rms_norm(x, weight, rope=rope)
    rms_norm.rms_norm_backward(_empty(x.shape, dtype), x, weight, rstd, eps=1e-5, rope=rope)


def rms_norm_gated_calls(dtype, gate):
    """The gated output norm of Gated DeltaNet (silu) or KDA (sigmoid), forward and
    backward: 64 tokens of 32 heads of 128 (Qwen3.5-35B's value heads)."""
    x, z, weight = _empty((64, 32, 128), dtype), _empty((64, 32, 128), dtype), _empty((128,), dtype)
    _, rstd = rms_norm.rms_norm_gated(x, z, weight, 1e-6, gate)
    rms_norm.rms_norm_gated_backward(
        _empty(x.shape, dtype), x, z, weight, rstd, eps=1e-6, gate=gate
    )


def gated_calls(dtype, activation):
    """The dense MLP's gated activation, forward and backward, over 256 rows of a
    14336-wide hidden layer (Llama 8B's)."""
    gate, up = _empty((256, 14336), dtype), _empty((256, 14336), dtype)
    gated.gated(gate, up, activation)
    gated.gated_backward(_empty((256, 14336), dtype), gate, up, activation)
    gated.gated_backward(
        _empty((256, 14336), dtype), gate, up, activation, hidden=True, stacked=True
    )


def rope_calls(dtype, rotary, pair=False):
    """Rotary embeddings of q at Llama 8B's shapes (32 heads of 128, 512 positions) as a
    strided view of a fused QKV projection, forward and backward; `rotary` dims rotate;
    `pair`: q and k (its 8 KV heads) in one launch each way."""
    qkv = _empty((1, 512, 48, 128), dtype)
    q, k = qkv[:, :, :32], qkv[:, :, 32:40]
    cos, sin = _empty((512, rotary // 2), "float32"), _empty((512, rotary // 2), "float32")
    for inverse in (False, True):
        if pair:
            rope.rope_pair(q, k, cos, sin, inverse=inverse)
        else:
            rope.rope(q, cos, sin, inverse=inverse)


# --- compile-gate cases ---

# RMSNorm: its launcher's fixed tile (whole rows), at Llama 8B's width in 16-bit (no spill
# allowed, and on an A100), and reported at 70B's width and in fp32; as a q/k head norm
# turning its output by RoPE, no spill allowed.
RMS_NORM_KERNELS = ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel")
for kernel in RMS_NORM_KERNELS:
    family = "rms_norm-" + kernel.strip("_").removesuffix("_kernel").removeprefix("rms_norm_")
    for cap in (90, 80):
        add(
            family,
            "bfloat16-d4096",
            rms_norm_calls,
            {"dtype": "bfloat16", "dim": 4096},
            kernel,
            cap,
            no_spill=True,
        )
    for dtype, dim in (("bfloat16", 8192), ("float32", 4096)):
        add(
            family,
            f"{dtype}-d{dim}",
            rms_norm_calls,
            {"dtype": dtype, "dim": dim},
            kernel,
            90,
            no_spill=False,
        )
    # a q/k head norm joined by RoPE: heads of 128, all turned (and on an A100) or half
    for rotary, cap in ((128, 90), (128, 80), (64, 90)):
        add(
            family,
            f"bfloat16-d128-rope{rotary}",
            rms_norm_calls,
            {"dtype": "bfloat16", "dim": 128, "rotary": rotary},
            kernel,
            cap,
            no_spill=True,
        )
    # the gated output norm (heads of 128): each gate, 16-bit (no spill, and on an A100)
    for gate, dtype, cap in (
        ("silu", "bfloat16", 90),
        ("silu", "bfloat16", 80),
        ("sigmoid", "bfloat16", 90),
        ("silu", "float32", 90),
    ):
        add(
            family,
            f"{dtype}-d128-gate-{gate}",
            rms_norm_gated_calls,
            {"dtype": dtype, "gate": gate},
            kernel,
            cap,
            no_spill=dtype == "bfloat16",
            match={"GATE": gate},
        )


# The gated activation: its launcher's fixed tile, each activation and mode (forward;
# backward; backward writing h again, the one-rank MLP's), in 16-bit (no spill, and on an
# A100) and reported in fp32.
for activation in gated.ACTIVATIONS:
    for backward, store_h in ((False, True), (True, False), (True, True)):
        family = "gated-" + ("backward" if backward else "forward") + ("-h" * backward * store_h)
        match = {"ACTIVATION": activation, "BACKWARD": backward, "STORE_H": store_h}
        for dtype, cap in (("bfloat16", 90), ("bfloat16", 80), ("float32", 90)):
            add(
                family,
                f"{activation}-{dtype}",
                gated_calls,
                {"dtype": dtype, "activation": activation},
                "_gated_kernel",
                cap,
                no_spill=dtype == "bfloat16",
                match=match,
            )


# RoPE: its launcher's fixed tile, each direction, whole and partial (GPT-NeoX's quarter)
# rotary, in 16-bit (no spill, and on an A100) and reported in fp32.
for inverse in (False, True):
    family = "rope-" + ("backward" if inverse else "forward")
    for rotary, dtype, cap in (
        (128, "bfloat16", 90),
        (128, "bfloat16", 80),
        (32, "bfloat16", 90),
        (128, "float32", 90),
    ):
        add(
            family,
            f"r{rotary}-{dtype}",
            rope_calls,
            {"dtype": dtype, "rotary": rotary},
            "_rope_kernel",
            cap,
            no_spill=dtype == "bfloat16",
            match={"INVERSE": inverse, "PAIR": False},
        )
    for cap in (90, 80):  # q and k in one launch, as ParallelAttention rotates them
        add(
            family,
            "pair-r128-bfloat16",
            rope_calls,
            {"dtype": "bfloat16", "rotary": 128, "pair": True},
            "_rope_kernel",
            cap,
            no_spill=True,
            match={"INVERSE": inverse, "PAIR": True},
        )


# --- opcheck cases (tests/test_compile.py runs them on 2 ranks) ---


def opcheck_cases(group: str) -> list:
    """(op, args) for the custom ops of RMSNorm, the gated activation and the gated MLP,
    RoPE: small and random, float inputs requiring grad (the autograd registration is
    exercised); `group`: the ranks'."""
    ops = torch.ops.fusedpar
    W = dist.get_world_size()
    xt = leaf(3, 4, 8).transpose(0, 1)  # (4, 3, 8), strided
    norm_rope = rope_tables(torch.arange(4), 6, 100.0)  # xt's 4 positions, 6 of 8 dims turned
    dy_t, rstd_t = torch.randn(4, 3, 8), torch.rand(4, 3)  # xt's gradient and rstd
    dy5, rstd5 = torch.randn(5, 8), torch.rand(5)
    zt = leaf(3, 4, 8).transpose(0, 1)  # z of xt's shape, strided
    return [
        (ops.rms_norm_gated, (xt, zt, leaf(8), 1e-6, "silu")),
        (
            ops.rms_norm_gated,
            (leaf(5, 8, dtype=torch.float16), leaf(5, 8), leaf(8), 1e-5, "sigmoid"),
        ),
        (
            ops.rms_norm_gated_backward,
            (dy_t, xt, zt, leaf(8), rstd_t, 1e-6, "silu", [True, True, True]),
        ),
        (
            ops.rms_norm_gated_backward,
            (dy5, leaf(5, 8), leaf(5, 8), leaf(8), rstd5, 1e-5, "sigmoid", [False, True, False]),
        ),
        (ops.rms_norm, (xt, leaf(8), 1e-5, 0.0, None, None)),
        (ops.rms_norm, (leaf(5, 8, dtype=torch.float16), leaf(8), 1e-6, 1.0, None, None)),
        (ops.rms_norm, (xt, leaf(8), 1e-5, 0.0, *norm_rope)),  # a q/k norm joined by RoPE
        (ops.rms_norm_backward, (dy_t, xt, leaf(8), rstd_t, 1e-5, 0.0, None, None, True, True)),
        (ops.rms_norm_backward, (dy_t, xt, leaf(8), rstd_t, 1e-5, 0.0, *norm_rope, True, True)),
        (
            ops.rms_norm_backward,
            (dy5, leaf(5, 8), leaf(8), rstd5, 1e-6, 1.0, None, None, False, True),
        ),
        # the gated activation (no autograd of its own: `_GatedDown` holds it): strided
        # (a fused gate/up's halves), each activation
        (ops.gated, (torch.randn(4, 16)[:, :8], torch.randn(4, 16)[:, 8:], "silu")),
        (ops.gated, (torch.randn(3, 5).half(), torch.randn(3, 5).half(), "gelu")),
        # the TP path's backward: the ring's dh GEMMs ending in dgate, dup, h (and classic
        # TP's plain GEMM: group ""), some gradients not asked for
        (
            ops.gated_down_backward,
            (
                torch.randn(3, 2, 8),
                torch.randn(3 * W, 2, 5),
                torch.randn(3 * W, 2, 5),
                torch.randn(8, 5),
                "gelu_tanh",
                group,
                1,
                [True, True, True],
            ),
        ),
        (
            ops.gated_down_backward,
            (
                torch.randn(4, 8),
                torch.randn(4, 5),
                torch.randn(4, 5),
                torch.randn(8, 5),
                "silu",
                "",
                1,
                [True, False, False],
            ),
        ),
        (
            ops.gated_down_backward,
            (
                torch.randn(2, 8),
                torch.randn(2 * W, 5),
                torch.randn(2 * W, 5),
                torch.randn(8, 5),
                "silu",
                group,
                2,
                [False, True, True],
            ),
        ),
        # RoPE: a strided head range of a projection, whole and partial rotary; q and k
        (ops.rope, ([leaf(2, 5, 7, 16)[:, :, 1:4]], torch.randn(5, 8), torch.randn(5, 8), False)),
        (
            ops.rope,
            ([leaf(1, 3, 2, 16, dtype=torch.float16)], torch.randn(3, 4), torch.randn(3, 4), True),
        ),
        (
            ops.rope,
            (
                [leaf(2, 5, 7, 16)[:, :, :4], leaf(2, 5, 7, 16)[:, :, 4:6]],
                torch.randn(5, 6),
                torch.randn(5, 6),
                False,
            ),
        ),
        # the one-rank gated MLP, with and without biases, some gradients not asked for
        (ops.gated_mlp, (xt, leaf(5, 8), leaf(5, 8), leaf(8, 5), [], "silu")),
        (
            ops.gated_mlp,
            (
                leaf(3, 8),
                leaf(5, 8),
                leaf(5, 8),
                leaf(8, 5),
                [leaf(5), leaf(5), leaf(8)],
                "gelu_tanh",
            ),
        ),
        (
            ops.gated_mlp_backward,
            (
                torch.randn(4, 3, 8),
                xt,
                torch.randn(4, 3, 5),
                torch.randn(4, 3, 5),
                torch.randn(5, 8),
                torch.randn(5, 8),
                torch.randn(8, 5),
                "silu",
                [True, False, True, True],
            ),
        ),
    ]
