"""`fp.nn.ParallelAttention` with the options of today's open models (q/k/v and o
biases, a head dim other than d_model / n_heads, per-head q/k RMSNorm with a softmax
scale, a rotary callable in Hugging Face's layout; no RoPE, partial rotary, Conv1D
modules and bare tensors with their biases) against a dense float64 module: the output, dx and
every parameter gradient (DTensor parameters on the mesh, gathered), at TP2 x CP2 with
and without sequence parallelism and on one rank; and `from_dense` refusing whatever it
would not compute exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedpar as fp
from fusedpar.testing import assert_close
from tests.attention.helpers import (
    BATCH,
    D_MODEL,
    GEMMA_SCALE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    SEQ,
    DenseAttention,
    scaled_rope,
)


def _to_local(t, groups):
    """(B, S, d) -> this rank's (S / CP / TP, B, d)."""
    t = fp.shard_sequence(t, groups["cp"], dim=1).transpose(0, 1)
    return t.chunk(fp.comm.group_size(groups["tp"]))[fp.comm.group_rank(groups["tp"])]


def _run_options(sequence_parallel, seed):
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cp = tp = 2 if world == 4 else 1
    dims = fp.ParallelDims(cp=cp, tp=tp)
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    torch.manual_seed(seed)
    dense = DenseAttention()
    x = torch.randn(BATCH, SEQ, D_MODEL)
    g = torch.randn(BATCH, SEQ, D_MODEL)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        module = DenseAttention().to(dtype)
        module.load_state_dict(dense.state_dict())
        xd = x.to(dtype, copy=True).requires_grad_()
        y = module(xd)
        y.backward(g.to(dtype))
        refs[dtype] = {
            "y": y.detach(),
            "dx": xd.grad,
            **{n: p.grad for n, p in module.named_parameters()},
        }

    layer = fp.nn.ParallelAttention.from_dense(
        dense.q,
        dense.k,
        dense.v,
        dense.o,
        D_MODEL,
        HEADS,
        KV_HEADS,
        q_norm=dense.q_norm,
        k_norm=dense.k_norm,
        rope=scaled_rope,
        tp_group=groups["tp"],
        cp_group=groups["cp"],
        sequence_parallel=sequence_parallel,
        softmax_scale=GEMMA_SCALE,
    )
    assert layer.head_dim == HEAD_DIM and layer.q_bias is not None and layer.o_bias is not None
    fp.distribute(layer, mesh, token_axes=("cp", "tp") if sequence_parallel else ("cp",))
    if sequence_parallel:
        x_local = _to_local(x, groups).requires_grad_()
        y = layer(x_local)
        y.backward(_to_local(g, groups))
        local = {
            dtype: {"y": _to_local(r["y"], groups), "dx": _to_local(r["dx"], groups)}
            for dtype, r in refs.items()
        }
    else:  # every TP rank holds the CP shard whole
        x_local = fp.shard_sequence(x, groups["cp"], dim=1).transpose(0, 1).requires_grad_()
        y = layer(x_local)
        y.backward(fp.shard_sequence(g, groups["cp"], dim=1).transpose(0, 1))
        local = {
            dtype: {
                name: fp.shard_sequence(r[name], groups["cp"], dim=1).transpose(0, 1)
                for name in ("y", "dx")
            }
            for dtype, r in refs.items()
        }
    for name, got in (("y", y), ("dx", x_local.grad)):
        assert_close(got, local[torch.float64][name], local[torch.float32][name], name=name)
    names = {
        "q_weight": "q.weight",
        "k_weight": "k.weight",
        "v_weight": "v.weight",
        "o_weight": "o.weight",
        "q_bias": "q.bias",
        "k_bias": "k.bias",
        "v_bias": "v.bias",
        "o_bias": "o.bias",
        "q_norm_weight": "q_norm.weight",
        "k_norm_weight": "k_norm.weight",
    }
    for name, param in layer.named_parameters():
        dense_name = names[name]
        assert_close(
            param.grad.full_tensor(),
            refs[torch.float64][dense_name],
            refs[torch.float32][dense_name],
            name=name,
            sum_length=SEQ,
        )
    return True


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "classic-tp"])
def test_every_option_matches_the_dense_module(world, sequence_parallel):
    assert all(world(4).run(_run_options, sequence_parallel, 0))


def test_every_option_on_one_rank(world):
    assert all(world(1).run(_run_options, True, 1))


def _dense_parts(**changes):
    torch.manual_seed(0)
    dense = DenseAttention()
    parts = {"q": dense.q, "k": dense.k, "v": dense.v, "o": dense.o}
    parts.update(changes)
    return parts


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda p: fp.nn.ParallelAttention.from_dense(
                *p.values(), D_MODEL, HEADS, KV_HEADS, bias=False
            ),
            r"dense q has a bias but this ParallelAttention was built with bias=False",
        ),
        (
            lambda p: fp.nn.ParallelAttention.from_dense(
                *p.values(), D_MODEL, HEADS, KV_HEADS, o_bias=False
            ),
            r"dense o has a bias .* o_bias=False",
        ),
        (
            lambda p: fp.nn.ParallelAttention.from_dense(
                *_dense_parts(k=nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM, bias=False)).values(),
                D_MODEL,
                HEADS,
                KV_HEADS,
            ),
            r"dense k has no bias but this ParallelAttention was built with bias=True",
        ),
        (
            lambda p: fp.nn.ParallelAttention.from_dense(
                *p.values(), D_MODEL, HEADS, KV_HEADS, q_norm=torch.ones(HEAD_DIM)
            ),
            r"k_norm missing but this ParallelAttention was built with qk_norm='head'",
        ),
        (
            lambda p: fp.nn.ParallelAttention.from_dense(
                *p.values(), D_MODEL, HEADS, KV_HEADS, head_dim=8
            ),
            r"dense q must be \(32, 32\) \(heads x head_dim 8\), got \(64, 32\)",
        ),
        (
            lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, 3, 1),
            r"dense q has 64 rows, not a multiple of n_heads \(3\)",
        ),
        (lambda p: fp.nn.ParallelAttention(D_MODEL, 4, head_dim=7), r"head_dim \(7\) must be even"),
        (lambda p: fp.nn.ParallelAttention(30, 4), r"d_model \(30\) is not divisible by n_heads"),
    ],
)
def test_from_dense_refuses_what_it_would_not_compute(build, match):
    with pytest.raises(ValueError, match=match):
        build(_dense_parts())


def test_a_bad_rope_table_is_refused():
    layer = fp.nn.ParallelAttention(
        D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, rope=lambda pos: (torch.ones(len(pos), 3),) * 2
    )
    match = r"cos, sin of \(8, 8\) or \(8, 16\) for rotary_dim 16, got \(8, 3\)"
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(8, 1, D_MODEL))


def test_swiglu_refuses_a_bias_it_has_no_place_for():
    gate, up, down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
    with pytest.raises(ValueError, match=r"dense gate has a bias .* bias=False"):
        fp.nn.ParallelSwiGLU.from_dense(gate, up, down, None, bias=False)
    with pytest.raises(ValueError, match=r"dense down has no bias .* bias=True"):
        fp.nn.ParallelSwiGLU.from_dense(gate, up, nn.Linear(16, 8, bias=False), None)


# ---- layers for models that are not Llama-shaped: no RoPE, softmax_scale, partial rotary,
# Conv1D modules and bare tensors with their biases

ROTARY = HEAD_DIM // 2  # GPT-NeoX's rotary_pct 0.5


def neox_rope(positions):
    """GPT-NeoX's rotary module at rotary_pct 0.5: Hugging Face's layout of width
    ROTARY, (1, S, ROTARY), the angles twice."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, ROTARY, 2, dtype=torch.float64) / ROTARY)
    angles = positions.double()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos(), angles.sin()


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the normalized values times (1 + weight), in fp32."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.randn(width) / 4)

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (normed * (1 + self.weight.float())).to(x.dtype)


class DenseVariant(nn.Module):
    """q/k/v/o with biases, GQA, causal; rotary on the first `rotary_dim` dims of each
    head (0: none), a softmax scale, and optionally q/k norms ("gemma": per head,
    (1 + w); "olmo": over all heads' width) and attention sinks."""

    def __init__(self, rotary_dim, scale, norm=None, sinks=False):
        super().__init__()
        self.rotary_dim, self.scale, self.norm = rotary_dim, scale, norm
        self.q = nn.Linear(D_MODEL, HEADS * HEAD_DIM)
        self.k = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        if norm == "gemma":
            self.q_norm, self.k_norm = GemmaRMSNorm(HEAD_DIM), GemmaRMSNorm(HEAD_DIM)
        elif norm == "olmo":
            self.q_norm = nn.RMSNorm(HEADS * HEAD_DIM, eps=1e-6)
            self.k_norm = nn.RMSNorm(KV_HEADS * HEAD_DIM, eps=1e-6)
            with torch.no_grad():
                self.q_norm.weight.uniform_(0.5, 1.5)
                self.k_norm.weight.uniform_(0.5, 1.5)
        self.sinks = nn.Parameter(torch.randn(HEADS)) if sinks else None

    def rotate(self, t):  # (B, S, H, hd): Hugging Face's rotate_half on the first r dims
        r = self.rotary_dim
        if r == 0:
            return t
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
        angles = torch.arange(t.shape[1], dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
        rot, rest = t[..., :r], t[..., r:]
        half = torch.cat([-rot[..., r // 2 :], rot[..., : r // 2]], dim=-1)
        return torch.cat([rot * cos + half * sin, rest], dim=-1)

    def forward(self, x):  # (B, S, d)
        B, S, _ = x.shape
        q, k = self.q(x), self.k(x)
        if self.norm == "olmo":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, S, HEADS, HEAD_DIM), k.view(B, S, KV_HEADS, HEAD_DIM)
        if self.norm == "gemma":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q).transpose(1, 2), self.rotate(k).transpose(1, 2)
        v = self.v(x).view(B, S, KV_HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) * (self.scale or HEAD_DIM**-0.5)  # (B, H, S, S)
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        if self.sinks is not None:  # one more column in the softmax, with no value
            sink = self.sinks.to(scores.dtype)[None, :, None, None].expand(B, HEADS, S, 1)
            scores = torch.cat([scores, sink], dim=-1)
        out = scores.softmax(-1)[..., :S] @ v
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 ``Conv1D`` (transformers.pytorch_utils): a linear layer with
    its weight stored transposed, (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.flatten(0, -2), self.weight).view(*x.shape[:-1], self.nf)


def as_conv1d(linear: nn.Linear) -> Conv1D:
    conv = Conv1D(linear.out_features, linear.in_features)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.t())
        conv.bias.copy_(linear.bias)
    return conv


# (the dense module's rotary_dim and norm, ParallelAttention options, how the dense parts
# are given; sinks=True also gives the dense module sinks)
VARIANTS = {
    "no-rope-scaled-tensors": (0, None, {"rope": None, "softmax_scale": 0.3}, "tensors"),
    "partial-hf-table-conv1d": (ROTARY, None, {"rope": neox_rope, "rotary_dim": ROTARY}, "conv1d"),
    "partial-default-tables": (
        ROTARY,
        None,
        {"rotary_dim": ROTARY, "softmax_scale": 0.2},
        "linear",
    ),
    "gemma-norms-sinks": (HEAD_DIM, "gemma", {"norm_offset": 1.0, "sinks": True}, "linear"),
    "olmo-full-width-norms": (HEAD_DIM, "olmo", {}, "linear"),
}


def _run_variants(seed):
    world = torch.distributed.get_world_size()
    dims = fp.ParallelDims(cp=2, tp=2) if world == 4 else fp.ParallelDims()
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    for name, (rotary_dim, norm, options, given) in VARIANTS.items():
        torch.manual_seed(seed)
        sinks = options.get("sinks", False)
        dense = DenseVariant(rotary_dim, options.get("softmax_scale"), norm, sinks)
        x, g = torch.randn(BATCH, SEQ, D_MODEL), torch.randn(BATCH, SEQ, D_MODEL)
        refs = {}
        for dtype in (torch.float64, torch.float32):
            module = DenseVariant(rotary_dim, dense.scale, norm, sinks).to(dtype)
            module.load_state_dict(dense.state_dict())
            xd = x.to(dtype, copy=True).requires_grad_()
            module(xd).backward(g.to(dtype))
            y = module(xd.detach())
            refs[dtype] = {
                "y": y.detach(),
                "dx": xd.grad,
                **{n: p.grad for n, p in module.named_parameters()},
            }
        parts = (dense.q, dense.k, dense.v, dense.o)
        if given == "tensors":
            parts, options = [p.weight for p in parts], {**options, "bias": [p.bias for p in parts]}
        elif given == "conv1d":
            parts = [as_conv1d(p) for p in parts]
        if norm is not None:
            options = {**options, "q_norm": dense.q_norm, "k_norm": dense.k_norm}
        if sinks:
            options = {**options, "sinks": dense.sinks}
        layer = fp.nn.ParallelAttention.from_dense(
            *parts,
            D_MODEL,
            HEADS,
            KV_HEADS,
            tp_group=groups["tp"],
            cp_group=groups["cp"],
            **options,
        )
        fp.distribute(layer, mesh)
        x_local = _to_local(x, groups).requires_grad_()
        y = layer(x_local)
        y.backward(_to_local(g, groups))
        for what, got in (("y", y), ("dx", x_local.grad)):
            expected = [_to_local(refs[dtype][what], groups) for dtype in refs]
            assert_close(got, *expected, name=f"{name}: {what}")
        for pname, param in layer.named_parameters():
            dense_name = pname.replace("_weight", ".weight").replace("_bias", ".bias")
            assert_close(
                param.grad.full_tensor(),
                refs[torch.float64][dense_name],
                refs[torch.float32][dense_name],
                name=f"{name}: {pname}",
                sum_length=SEQ,
            )
    return True


def test_layers_for_models_that_are_not_llama_shaped(world):
    """rope=None (GPT-2's learned positions), softmax_scale, partial rotary with the
    default tables or a Hugging Face half-width table, Conv1D modules and bare tensors
    with bias=, Gemma's (1 + w) q/k norms with attention sinks, OLMo 2's q/k norms over
    the full width (statistics summed over TP): output, dx and every gradient at TP2 x
    CP2 against float64."""
    assert all(world(4).run(_run_variants, 3))


def test_a_half_width_hf_table_is_never_taken_for_the_full_layout():
    """GPT-NeoX at rotary_pct 0.5 with its own rotary module and no rotary_dim: the
    table has the width of this layer's own full-rotary layout, but its halves repeat."""
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, rope=neox_rope)
    with pytest.raises(
        ValueError,
        match=r"Hugging Face's layout for rotary_dim 8.*"
        r"pass rotary_dim=8",
    ):
        layer(torch.randn(8, 1, D_MODEL))
    layer = fp.nn.ParallelAttention(
        D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, rope=neox_rope, rotary_dim=ROTARY
    )
    assert layer(torch.randn(8, 1, D_MODEL)).shape == (8, 1, D_MODEL)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rotary_dim": 8},  # in the GEMMs' epilogue; partial: one launch after them
        {"qk_norm": "head"},
        {"qk_norm": "head", "rotary_dim": 8},  # in the norm's kernel
        {"sequence_parallel": False},  # classic TP's GEMMs too
    ],
)
def test_rope_joins_the_qkv_projection_or_the_head_norm(monkeypatch, options, triton_kernels):
    """With no q/k norm, q and k leave `all_gather_matmul` turned (its GEMMs' epilogue,
    or one launch after them for partial rotary; classic TP's GEMMs gather nothing); with
    a per-head q/k norm, its kernel turns them (`rms_norm`'s ``rope=``). Either way the
    layer rotates nothing itself, and the output is the one the separate rotation
    gives."""
    from fusedpar.nn import attention

    x = torch.randn(8, 2, D_MODEL)
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, **options)
    expected = layer(x)
    calls = []
    rotate = attention.apply_rope_qk
    monkeypatch.setattr(attention, "apply_rope_qk", lambda *a: calls.append(1) or rotate(*a))
    monkeypatch.setattr(attention, "rotates_by_formula", lambda *a: True)  # never joined
    monkeypatch.setattr(attention, "joins_rope", lambda *a: False)
    torch.testing.assert_close(layer(x), expected, atol=2e-5, rtol=1e-5)
    assert len(calls) == 1
    monkeypatch.undo()
    monkeypatch.setattr(attention, "apply_rope_qk", lambda *a: calls.append(1) or rotate(*a))
    layer(x)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"rope": False}, TypeError, r"rope must be a callable .* None \(no rotary embedding\)"),
        ({"rope": None, "rotary_dim": 8}, ValueError, r"rotary_dim=8 with rope=None"),
        ({"rotary_dim": 6 + HEAD_DIM}, ValueError, r"rotary_dim \(22\) must be even and in \(0, "),
        ({"rotary_dim": 5}, ValueError, r"rotary_dim \(5\) must be even"),
        ({"softmax_scale": 0.0}, ValueError, r"softmax_scale must be > 0 and finite"),
        ({"softmax_scale": float("inf")}, ValueError, r"softmax_scale must be > 0 and finite"),
    ],
)
def test_bad_layer_options_raise(options, error, match):
    with pytest.raises(error, match=match):
        fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, **options)


def test_biases_beside_tensors_are_checked():
    torch.manual_seed(0)
    dense = DenseVariant(0, None)
    weights = [dense.q.weight, dense.k.weight, dense.v.weight, dense.o.weight]
    biases = [dense.q.bias, dense.k.bias, dense.v.bias, dense.o.bias]
    build = fp.nn.ParallelAttention.from_dense
    layer = build(*weights, D_MODEL, HEADS, KV_HEADS, bias=biases)
    assert layer.has_bias and torch.equal(layer.o_bias, dense.o.bias)
    with pytest.raises(ValueError, match=r"one bias \(a tensor or None\) per dense weight, 4"):
        build(*weights, D_MODEL, HEADS, KV_HEADS, bias=biases[:3])
    with pytest.raises(ValueError, match=r"a bias given for dense q, a Linear that has its own"):
        build(dense.q, *weights[1:], D_MODEL, HEADS, KV_HEADS, bias=biases)
    with pytest.raises(ValueError, match=r"the bias of dense k must be a \(32,\) tensor"):
        build(*weights, D_MODEL, HEADS, KV_HEADS, bias=[biases[0], biases[0], *biases[2:]])
    with pytest.raises(ValueError, match=r"dense k has no bias .* bias=True"):
        build(*weights, D_MODEL, HEADS, KV_HEADS, bias=[biases[0], None, *biases[2:]])


def test_linears_take_conv1d_modules_and_tensors_with_biases():
    """One rank: each form gives the dense layer's function exactly."""
    torch.manual_seed(0)
    linear = nn.Linear(12, 20)
    x = torch.randn(5, 3, 12)
    for cls in (fp.nn.ColumnParallelLinear, fp.nn.RowParallelLinear):
        for dense, bias in ((as_conv1d(linear), None), (linear.weight, linear.bias)):
            layer = cls.from_dense(dense, None, bias=bias)
            torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=1e-6)
    gate, up, down = nn.Linear(12, 20), nn.Linear(12, 20), nn.Linear(20, 12)
    expected = down(F.silu(gate(x)) * up(x))
    convs = fp.nn.ParallelSwiGLU.from_dense(*map(as_conv1d, (gate, up, down)), None)
    tensors = fp.nn.ParallelSwiGLU.from_dense(
        gate.weight, up.weight, down.weight, None, bias=(gate.bias, up.bias, down.bias)
    )
    for mlp in (convs, tensors):
        torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "options, frozen, packed",
    [
        ({}, (), False),
        ({"bias": True, "o_bias": True, "rotary_dim": 8}, ("x", "q_weight", "k_bias"), False),
        ({"qk_norm": "head", "norm_offset": 1.0, "rotary_dim": 8}, ("k_norm_weight",), False),
        ({"rope": None, "sliding_window": 3, "softcap": 5.0, "softmax_scale": 0.3}, (), False),
        ({"qk_norm": "head", "dtype": torch.float16}, ("o_weight",), True),
    ],
)
def test_one_rank_is_one_op_with_the_composed_paths_bits(
    monkeypatch, options, frozen, packed, each_implementation
):
    """On one rank the layer is one op (`fusedpar::attention_layer`): the output and every
    gradient asked for are bit for bit those of the composed path (`all_gather_matmul`,
    the head norms, `flash_attn`, `matmul_reduce_scatter`), with biases, partial rotary,
    head norms (Gemma's offset), no RoPE with a window, softcap and scale, packed
    documents in fp16, and some gradients not asked for."""
    from fusedpar.nn import attention

    dtype = options.get("dtype", torch.float32)
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, **options)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):  # re-drawn: biases and norms never trivial
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
    for name in frozen:
        if name != "x":
            layer.get_parameter(name).requires_grad_(False)
    batch = 1 if packed else BATCH
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32) if packed else None
    x, dy = (torch.randn(12, batch, D_MODEL).to(dtype) for _ in range(2))
    ops = []
    attention_layer = attention.attention_layer
    monkeypatch.setattr(
        attention, "attention_layer", lambda *a, **k: ops.append(1) or attention_layer(*a, **k)
    )

    def run():
        xr = x.clone().requires_grad_("x" not in frozen)
        y = layer(xr, cu)
        y.backward(dy)
        grads = [p.grad for p in layer.parameters() if p.requires_grad]
        layer.zero_grad(set_to_none=True)
        return [y, *([] if "x" in frozen else [xr.grad]), *grads]

    one_op = run()
    assert ops == [1]
    monkeypatch.setattr(attention, "takes_one_op", lambda *a: False)
    composed = run()
    assert ops == [1] and len(one_op) == len(composed)
    for got, expected in zip(one_op, composed, strict=True):
        assert torch.equal(got, expected)


def test_one_rank_refuses_a_parameter_of_another_dtype_naming_it():
    """The one-op path checks every parameter against x, as the composed path's ops do,
    before any work."""
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM, bias=True)
    layer.k_bias.data = layer.k_bias.data.double()
    with pytest.raises(TypeError, match="x is torch.float32 on cpu but k_bias is torch.float64"):
        layer(torch.randn(4, 2, D_MODEL))
