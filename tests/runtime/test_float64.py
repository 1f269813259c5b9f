"""float64 everywhere torch's implementation runs: every public op and layer takes it, on
the CPU and (the GPU tier) on CUDA under ``auto``, computed in float64 throughout, so a
float64 result equals its float64 reference to a few ulps (`assert_ulps`): forward and
every gradient, one process and over gloo (ring, Ulysses, the TP rings, EP, the
layers). An explicit ``triton`` request with float64 is a TypeError, before any
collective; the tuner never times a Triton tile for float64; the custom ops' fakes give
float64 LSEs and rstd, as the ops do. The TP2 x CP2 block against its dense twin is
docs/testing.md's example (tests/project/test_docs.py); the Hugging Face model is in
tests/hf/test_hf.py."""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fusedpar.kernels import impl, tuning
from fusedpar.kernels.attention import AttentionMask, attention_reference
from fusedpar.kernels.linear_attention.conv1d import causal_conv1d_reference
from fusedpar.kernels.rms_norm import rms_norm_gated_reference, rms_norm_reference
from torch import nn

import fusedpar as fp
from fusedpar.nn.attention_parts import rope_tables
from fusedpar.ops.attention import rope
from fusedpar.ops.moe import Experts, moe_reference
from fusedpar.testing import assert_ulps, exception_of
from fusedpar.testing.strategies import randn
from tests.attention.helpers import GEMMA_SCALE, HEAD_DIM, DenseAttention, scaled_rope

F64 = torch.float64


def _leaves(*tensors):
    """Fresh leaves (copies that take a gradient) of `tensors`."""
    return [t.detach().clone().requires_grad_() for t in tensors]


def _compare(fn, ref_fn, inputs, seed, what):
    """``fn`` and ``ref_fn`` on float64 leaves of `inputs`: every output, then every
    input's gradient under a random upstream gradient, to 16 ulps."""
    results = []
    for f in (fn, ref_fn):
        leaves = _leaves(*inputs)
        outs = f(*leaves)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        upstream = [randn(o.shape, F64, seed + 100 + i).to(o.device) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, upstream)
        results.append([o.detach() for o in outs] + [t.grad for t in leaves])
    for i, (got, ref) in enumerate(zip(*results, strict=True)):
        assert got.dtype == F64, f"{what}[{i}] is {got.dtype}"
        assert_ulps(got, ref, name=f"{what}[{i}]")


def _rotate(x, cos, sin):
    """RoPE's formula on x (..., S, H, hd) by (S, r/2) tables, the last hd - r dims passing."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half :]], dim=-1)


def check_ops(device):
    """Every single-device op in float64 on `device` against plain PyTorch in float64."""

    def r(shape, seed):
        return randn(shape, F64, seed).to(device)

    q, k, v, sinks = r((2, 11, 4, 16), 0), r((2, 11, 2, 16), 1), r((2, 11, 2, 16), 2), r((4,), 3)
    _compare(
        lambda q, k, v, s: fp.flash_attn(q, k, v, causal=True, sinks=s, return_lse=True),
        lambda q, k, v, s: attention_reference(q, k, v, AttentionMask(True, sinks=s)),
        (q, k, v, sinks),
        4,
        "flash_attn",
    )
    mask = dict(window=(3, 0), softcap=2.5, softmax_scale=0.3)  # Sq < Skv: bottom-right
    _compare(
        lambda *t: fp.flash_attn(*t, causal=True, return_lse=True, **mask),
        lambda *t: attention_reference(*t, AttentionMask(True, **mask)),
        (q[:, :7], k, v),
        5,
        "flash_attn window softcap",
    )
    qs, ks, vs = r((1, 12, 4, 8), 21), r((1, 12, 2, 8), 22), r((1, 12, 2, 8), 23)
    _compare(
        lambda *t: fp.ops.virtual_ring_attn(*t, 3, causal=True, return_lse=True),
        lambda *t: attention_reference(*t, AttentionMask(causal=True)),
        (qs, ks, vs),
        24,
        "virtual_ring_attn",
    )
    cu = torch.tensor([0, 5, 5, 12, 17], dtype=torch.int32, device=device)

    def by_document(q, k, v):  # each document alone
        parts = [
            attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], AttentionMask(True))
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        ]
        return torch.cat([o[0] for o, _ in parts]), torch.cat([lse[0] for _, lse in parts], -1)

    _compare(
        lambda *t: fp.flash_attn_varlen(*t, cu, causal=True, return_lse=True),
        by_document,
        (r((17, 4, 8), 6), r((17, 2, 8), 7), r((17, 2, 8), 8)),
        9,
        "flash_attn_varlen",
    )
    # RoPE (partial: 12 of 16 dims) and RMSNorm with it, float64 tables
    cos, sin = rope_tables(torch.arange(11, device=device) * 3 + 1, 12, 100.0, F64)
    _compare(lambda x: rope(x, cos, sin), lambda x: _rotate(x, cos, sin), (q,), 10, "rope")
    x, weight = r((11, 2, 3, 16), 11), r((16,), 12)
    options = dict(offset=1.0, rope=(cos, sin))
    _compare(
        lambda x, w: fp.rms_norm(x, w, 1e-6, **options),
        lambda x, w: rms_norm_reference(x, w, 1e-6, **options),
        (x, weight),
        13,
        "rms_norm",
    )
    # the TP ops with no group (plain GEMMs; over gloo: `_sharded`), a rotated output
    x, w1, w2, b1 = r((6, 2, 16), 14), r((24, 16), 15), r((8, 16), 16), r((24,), 17)
    table = rope_tables(torch.arange(6, device=device), 8, 100.0, F64)
    _compare(
        lambda x, w1, w2, b1: fp.all_gather_matmul(
            x, [w1, w2], None, bias=[b1, None], rope=table, rotate=[True, False]
        ),
        lambda x, w1, w2, b1: [
            _rotate(F.linear(x, w1, b1).unflatten(-1, (3, 8)).transpose(0, 1), *table)
            .transpose(0, 1)
            .flatten(-2),
            F.linear(x, w2),
        ],
        (x, w1, w2, b1),
        18,
        "all_gather_matmul",
    )
    _compare(
        lambda x, w, b: fp.matmul_reduce_scatter(x, w, None, bias=b),
        F.linear,
        (x, w2, r((8,), 19)),
        20,
        "matmul_reduce_scatter",
    )
    _compare(
        lambda x, z, w: fp.ops.rms_norm_gated(x, z, w, eps=1e-6),
        lambda x, z, w: rms_norm_gated_reference(x, z, w, 1e-6),
        (r((3, 2, 8), 21), r((3, 2, 8), 22), r((8,), 23)),
        24,
        "rms_norm_gated",
    )
    cu = torch.tensor([0, 2, 9], dtype=torch.int32, device=device)
    conv = dict(cu_seqlens=cu, output_final_states=True)
    _compare(
        lambda x, w, b, s: fp.ops.causal_conv1d(x, w, b, initial_states=s, **conv),
        lambda x, w, b, s: causal_conv1d_reference(x, w, b, "silu", cu, s, True),
        (r((1, 9, 5), 25), r((5, 4), 26), r((5,), 27), r((2, 5, 3), 28)),
        29,
        "causal_conv1d",
    )
    return True


def _moe_case(ep_group, seed, device="cpu"):
    """fp.nn.MoE in float64 (a shared expert and its gate, top 2 of 4) against the naive
    float64 loop, the router's and the experts' gradients included: its output for this
    rank's tokens and the gradients summed over the ranks."""
    E, d, h, top_k, T = 4, 12, 10, 2, 7
    full = {
        name: randn(shape, F64, seed + i) * 0.5
        for i, (name, shape) in enumerate(
            [
                ("router", (E, d)),
                ("w1", (E, h, d)),
                ("w2", (E, d, h)),
                ("w3", (E, h, d)),
                ("s1", (6, d)),
                ("s2", (d, 6)),
                ("s3", (6, d)),
                ("gate", (1, d)),
            ]
        )
    }
    layer = fp.nn.MoE.from_dense(
        full["router"],
        full["w1"],
        full["w2"],
        full["w3"],
        ep_group,
        top_k=top_k,
        shared=(full["s1"], full["s2"], full["s3"]),
        shared_gate_weight=full["gate"],
    ).to(device)
    rank = fp.comm.group_rank(ep_group)
    x = randn((T, d), F64, seed + 20 + rank).to(device).requires_grad_()
    dy = randn((T, d), F64, seed + 30 + rank).to(device)
    y, aux = layer(x)
    (torch.sum(y * dy) + aux).backward()
    leaves = {n: t.to(device).requires_grad_() for n, t in full.items()}
    xr = x.detach().clone().requires_grad_()
    yr, auxr = moe_reference(
        xr,
        layer.spec,
        leaves["router"],
        Experts(leaves["w1"], leaves["w3"], leaves["w2"]),
        shared=(leaves["s1"], leaves["s2"], leaves["s3"]),
        shared_gate=leaves["gate"],
    )
    (torch.sum(yr * dy) + auxr).backward()
    assert_ulps(y, yr.detach(), name="MoE y")
    assert_ulps(aux.reshape(1), auxr.detach().reshape(1), name="MoE aux")
    assert_ulps(x.grad, xr.grad, name="MoE dx")
    size, local = fp.comm.group_size(ep_group), E // fp.comm.group_size(ep_group)
    mine = slice(rank * local, (rank + 1) * local)
    names = {
        "router_weight": "router",
        "w1": "w1",
        "w2": "w2",
        "w3": "w3",
        "shared_w1": "s1",
        "shared_w2": "s2",
        "shared_w3": "s3",
        "shared_gate_weight": "gate",
    }
    for name, param in layer.named_parameters():
        ref = leaves[names[name]].grad
        if size > 1:  # the reference saw this rank's tokens only: sum over the ranks
            dist.all_reduce(ref)
            got = param.grad.clone()
            if name not in ("w1", "w2", "w3"):  # whole on every rank: this rank's share
                dist.all_reduce(got)
        else:
            got = param.grad
        assert_ulps(got, ref[mine] if name in ("w1", "w2", "w3") else ref, name=f"MoE {name}")
    return True


def _grads_match(layer, twins: dict, what: str) -> None:
    """Each parameter's gradient (gathered where a DTensor) against its twin's (moved to
    the layer's device)."""
    for name, param in layer.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        assert_ulps(grad, twins[name].grad.to(grad.device), name=f"{what} {name}")


def check_layers(device):
    """Every layer at one rank (no group) in float64 on `device` against nn's float64:
    output, dx and every parameter's gradient."""
    torch.manual_seed(0)
    x = randn((5, 2, 12), F64, 1).to(device)
    first, second = nn.Linear(12, 20, dtype=F64).to(device), nn.Linear(20, 12, dtype=F64).to(device)
    column = fp.nn.ColumnParallelLinear.from_dense(first, None)
    row = fp.nn.RowParallelLinear.from_dense(second, None)
    _compare(lambda x: row(column(x)), lambda x: second(first(x)), (x,), 2, "linears")
    _grads_match(column, dict(first.named_parameters()), "ColumnParallelLinear")
    _grads_match(row, dict(second.named_parameters()), "RowParallelLinear")
    gate, up, down = (nn.Linear(*io, dtype=F64).to(device) for io in ((12, 18), (12, 18), (18, 12)))
    swiglu = fp.nn.ParallelSwiGLU.from_dense(gate, up, down, None)  # one rank: one op
    _compare(swiglu, lambda x: down(F.silu(gate(x)) * up(x)), (x,), 3, "ParallelSwiGLU")
    _grads_match(
        swiglu,
        {
            f"{n}_{leaf}": getattr(m, leaf)
            for n, m in (("gate", gate), ("up", up), ("down", down))
            for leaf in ("weight", "bias")
        },
        "ParallelSwiGLU",
    )
    norm = fp.nn.RMSNorm(12, 1e-6, dtype=F64).to(device)
    twin = nn.RMSNorm(12, 1e-6, dtype=F64).to(device)
    with torch.no_grad():
        norm.weight.normal_()
        twin.weight.copy_(norm.weight)
    _compare(norm, twin, (x,), 4, "RMSNorm")
    _grads_match(norm, dict(twin.named_parameters()), "RMSNorm")
    _attention_case(None, 0, device)
    _moe_case(None, 5, device)
    return True


def _attention_case(mesh, seed, device="cpu"):
    """`ParallelAttention` in float64 (biases, q/k head norms, a rotary callable, GQA,
    softmax scale) on `device` against the dense float64 module of
    tests/attention/test_attention_layer.py (on the CPU), at TP2 x CP2 on `mesh` (its parameters
    distributed) or on one rank (None): output, dx and every gradient (gathered)."""
    torch.manual_seed(seed)
    dense = DenseAttention().double()
    x = randn((2, 16, dense.q.in_features), F64, seed + 1).requires_grad_()
    g = randn(x.shape, F64, seed + 2)
    y = dense(x)
    y.backward(g)
    groups = dict.fromkeys(("tp", "cp"))
    if mesh is not None:
        groups = fp.ParallelDims(cp=2, tp=2).groups(mesh)
    tp, cp = groups["tp"], groups["cp"]
    layer = fp.nn.ParallelAttention.from_dense(
        dense.q,
        dense.k,
        dense.v,
        dense.o,
        dense.q.in_features,
        4,
        2,
        q_norm=dense.q_norm,
        k_norm=dense.k_norm,
        tp_group=tp,
        cp_group=cp,
        softmax_scale=GEMMA_SCALE,
        rope=lambda positions: [t.to(positions.device) for t in scaled_rope(positions.cpu())],
    ).to(device)
    assert layer.head_dim == HEAD_DIM
    if mesh is not None:
        fp.distribute(layer, mesh)

    def local(t):  # (B, S, d) -> this rank's (S / CP / TP, B, d) on `device`
        t = fp.shard_sequence(t, cp, dim=1).transpose(0, 1)
        return t.chunk(fp.comm.group_size(tp))[fp.comm.group_rank(tp)].to(device)

    x_local = local(x.detach()).requires_grad_()
    y_local = layer(x_local)
    y_local.backward(local(g))
    assert_ulps(y_local, local(y.detach()), name="ParallelAttention y")
    assert_ulps(x_local.grad, local(x.grad), name="ParallelAttention dx")
    twins = {
        name: dense.get_parameter(
            name.replace("_norm_weight", "_norm.weight")
            .replace("_weight", ".weight")
            .replace("_bias", ".bias")
        )
        for name, _ in layer.named_parameters()
    }
    _grads_match(layer, twins, "ParallelAttention")
    return True


def test_every_op_takes_float64():
    assert check_ops("cpu")


def test_every_layer_takes_float64():
    assert check_layers("cpu")


@pytest.mark.gpu
def test_every_op_and_layer_takes_float64_on_cuda_and_times_no_tile():
    """On CUDA under ``auto``: torch's implementation computes float64 (the same checks
    as the CPU tier), and the tuner timed nothing for it: no Triton tile is a candidate."""
    tuning.forget_picks()
    with fp.implementation("auto"):
        assert check_ops("cuda") and check_layers("cuda")
    picks = tuning.all_picks()
    assert not any("float64" in key for kernel in picks.values() for key in kernel), picks


def _sharded(seed):
    """On 4 ranks over gloo, float64: ring and Ulysses attention (CP 4, GQA, sinks), the
    TP rings (TP 4), MoE at EP 4 and ParallelAttention at TP2 x CP2, each against float64
    on one device; the ring op's LSE is float64."""
    world = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    # q (4 heads), k and v (2: GQA), the whole sequence on every rank
    full = [randn((1, 16, heads, 8), F64, seed + i) for i, heads in enumerate((4, 2, 2))]
    sinks = randn((4,), F64, seed + 3)

    def shards(*t):
        return [fp.shard_sequence(u, world) for u in t]

    reference = lambda q, k, v, s: attention_reference(q, k, v, AttentionMask(True, sinks=s))[0]  # noqa: E731
    for name, attend, layout in (
        ("ring_attn", fp.ring_attn, "zigzag"),
        ("ulysses_attn", fp.ulysses_attn, "contiguous"),
    ):
        got_in, ref_in = _leaves(*full, sinks), _leaves(*full, sinks)
        q, k, v = (fp.shard_sequence(t, world, layout=layout) for t in got_in[:3])
        out = attend(q, k, v, world, causal=True, sinks=got_in[3])
        ref = reference(*ref_in)
        dout = randn(ref.shape, F64, seed + 4)
        out.backward(fp.shard_sequence(dout, world, layout=layout))
        ref.backward(dout)
        assert_ulps(out, fp.shard_sequence(ref.detach(), world, layout=layout), name=name)
        dist.all_reduce(got_in[3].grad)  # the sinks: each rank's rows' share
        for i, (a, b) in enumerate(zip(got_in, ref_in, strict=True)):  # (q, k, v: gathered)
            assert_ulps(a.grad, b.grad, name=f"{name} grad {i}")
    # the TP rings: all_gather_matmul then matmul_reduce_scatter, biases, tokens split
    x, w1 = randn((4 * 5, 2, 12), F64, seed + 5), randn((4 * 6, 12), F64, seed + 6)
    w2, b2 = randn((12, 4 * 6), F64, seed + 7), randn((12,), F64, seed + 8)
    leaves, ref_leaves = _leaves(x, w1, w2, b2), _leaves(x, w1, w2, b2)
    mine = slice(rank * 6, (rank + 1) * 6)
    xs = leaves[0].chunk(size)[rank]
    h = fp.all_gather_matmul(xs, leaves[1][mine], world)
    y = fp.matmul_reduce_scatter(torch.tanh(h), leaves[2][:, mine], world, bias=leaves[3])
    ref = F.linear(torch.tanh(F.linear(ref_leaves[0], ref_leaves[1])), ref_leaves[2], ref_leaves[3])
    dy = randn(ref.shape, F64, seed + 9)
    y.backward(dy.chunk(size)[rank])
    ref.backward(dy)
    assert_ulps(y, ref.detach().chunk(size)[rank], name="TP rings y")
    for i, (a, b) in enumerate(zip(leaves, ref_leaves, strict=True)):
        grad = a.grad.clone()
        dist.all_reduce(grad)
        assert_ulps(grad, b.grad, name=f"TP rings grad {i}")
    _moe_case(world, seed + 10)
    _attention_case(fp.ParallelDims(cp=2, tp=2).build_mesh("cpu"), seed + 11)
    # the ring op's LSE: float64, as its fake says (`test_the_fakes_declare_float64`)
    q, k, v = shards(*full)
    causal = fp.AttentionMask(causal=True).flat()
    ring = (fp.comm.group_name(world), "zigzag", causal, False, None)
    assert torch.ops.fusedpar.ring_attn(q, k, v, *ring)[1].dtype == F64
    return True


def test_float64_over_gloo(world):
    assert all(world(4).run(_sharded, 0))


def _fake_results(op, args):
    """`op` on fake copies of `args` (shapes and dtypes from its registered fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return op(*fakes)


def test_the_fakes_declare_float64():
    """The ops whose fakes name a dtype (the LSE, rstd, the router's outputs): in float64
    the fake gives what the op does (opcheck's fake-tensor test, without compiling). The
    ring's fake is checked here (no group needed), its real LSE in `_sharded`."""
    ops = torch.ops.fusedpar
    q, k, v = (
        randn(s, F64, i) for i, s in enumerate([(1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16)])
    )
    opts = ([], fp.AttentionMask(causal=True).flat(), False)
    out, lse = ops.flash_attn(q, k, v, *opts)
    x, w = randn((6, 8), F64, 3), randn((8,), F64, 4)
    cases = [
        (ops.flash_attn, (q, k, v, *opts)),
        (
            ops.flash_attn_backward,
            (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *opts),
        ),
        (ops.rms_norm, (x, w, 1e-6, 0.0, None, None)),
        (
            ops.rms_norm_backward,
            (
                torch.randn(6, 8, dtype=F64),
                x,
                w,
                torch.rand(6, dtype=F64),
                1e-6,
                0.0,
                None,
                None,
                True,
                True,
            ),
        ),
        (ops.moe_route, (randn((5, 4), F64, 5), None, 2, "softmax", True)),
        (
            ops.moe_route_backward,
            (
                None,
                torch.rand(5, 4, dtype=F64),
                torch.rand(5, 4, dtype=F64),
                torch.zeros(5, 2, dtype=torch.int32),
                "softmax",
                True,
            ),
        ),
    ]
    for op, args in cases:
        real, fake = op(*args), _fake_results(op, args)
        for i, (a, b) in enumerate(zip(real, fake, strict=True)):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (op, i, a.dtype, b.dtype)
        assert any(t.dtype == F64 for t in real)
    causal = fp.AttentionMask(causal=True).flat()
    ring = ("any group", "zigzag", causal, False, None)  # (its fake reads none)
    fake = _fake_results(ops.ring_attn, (q, k, v, *ring))
    assert [t.dtype for t in fake] == [F64, F64]


TRITON_FLOAT64 = "is float64: fusedpar's Triton kernels take float16, bfloat16 and float32"


def _refused(name):
    """A float64 call of each kind: ops, layers, and a launcher reached directly."""
    q = randn((1, 8, 2, 8), F64, 0)
    x, w = randn((4, 8), F64, 1), randn((6, 8), F64, 2)
    calls = {
        "flash_attn": lambda: fp.flash_attn(q, q, q, causal=True),
        "all_gather_matmul": lambda: fp.all_gather_matmul(x, w, None),
        "rms_norm": lambda: fp.rms_norm(x, w[0], 1e-6),
        "ParallelSwiGLU": lambda: fp.nn.ParallelSwiGLU(8, 12, dtype=F64)(x[:, None]),
        "MoE": lambda: fp.nn.MoE(8, 12, 4, 2, dtype=F64)(x),
        "matmul": lambda: fp.kernels.matmul.matmul(x, w.t()),
    }
    return calls[name]


@pytest.mark.parametrize(
    "name", ["flash_attn", "all_gather_matmul", "rms_norm", "ParallelSwiGLU", "MoE", "matmul"]
)
@pytest.mark.parametrize("how", ["context", "environment"])
def test_triton_refuses_float64(how, name, monkeypatch):
    """Asked for Triton's kernels, float64 is a TypeError naming the dtypes they take and
    where float64 runs; never a silent switch to torch's implementation."""
    call = _refused(name)
    if how == "environment":
        monkeypatch.setenv("FUSEDPAR_IMPL", "triton")
        with pytest.raises(TypeError, match=TRITON_FLOAT64):
            call()
        return
    with fp.implementation("triton"), pytest.raises(TypeError, match=TRITON_FLOAT64):
        call()


def _ring_under_triton():
    q = fp.shard_sequence(randn((1, 8, 2, 8), F64, 0), dist.group.WORLD)
    return fp.ring_attn(q, q, q, dist.group.WORLD, causal=True)


def test_triton_refuses_float64_on_every_rank_before_any_collective(world, triton_kernels):
    errors = world(4).run(exception_of, _ring_under_triton)
    assert all(isinstance(e, TypeError) and TRITON_FLOAT64 in str(e) for e in errors), errors


def test_float64_runs_torch_and_is_no_tuning_candidate():
    """The rule the launchers ask (`impl.runs_torch`), on a CUDA tensor's description
    (no GPU here): float64 runs torch's implementation outright under ``auto`` and
    ``torch`` (so no tuner, which would time Triton's tiles, is reached), a TypeError
    under ``triton``; fp32 on CUDA under ``auto`` still tunes."""
    cuda = torch.device("cuda")
    f64, f32 = (
        types.SimpleNamespace(dtype=d, device=cuda, shape=(2, 3)) for d in (F64, torch.float32)
    )
    for name in ("auto", "torch"):
        with fp.implementation(name):
            assert impl.runs_torch(f64)
    with fp.implementation("auto"):
        assert not impl.runs_torch(f32) and impl.tunes_torch()
    with fp.implementation("triton"), pytest.raises(TypeError, match=TRITON_FLOAT64):
        impl.runs_torch(f64)
