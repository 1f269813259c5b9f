"""`fp.nn.ParallelAttention` with the options of today's open models (q/k/v and o
biases, a head dim other than d_model / n_heads, per-head q/k RMSNorm, a rotary
callable in Hugging Face's layout) against a dense float64 module: the output, dx and
every parameter gradient (DTensor parameters on the mesh, gathered), at TP2 x CP2 with
and without sequence parallelism and on one rank; and `from_dense` refusing whatever it
would not compute exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedpar as fp
from fusedpar.testing import assert_close

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH = 32, 4, 2, 16, 16, 2


def scaled_rope(positions):
    """A rotary variant (linear scaling by 4), in Hugging Face's layout: (1, S, hd), the
    angles twice."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions.double()[:, None] * inv_freq[None, :] / 4
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos(), angles.sin()


class DenseAttention(nn.Module):
    """The single-device module: biases, head dim 16, q/k norms, scaled RoPE, GQA."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D_MODEL, HEADS * HEAD_DIM)
        self.k = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, D_MODEL)
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6), nn.RMSNorm(HEAD_DIM, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):  # (B, S, d)
        B, S, _ = x.shape
        q = self.q_norm(self.q(x).view(B, S, HEADS, HEAD_DIM))
        k = self.k_norm(self.k(x).view(B, S, KV_HEADS, HEAD_DIM))
        cos, sin = (t[0, :, None, :].to(x.dtype) for t in scaled_rope(torch.arange(S)))

        def rotate(t):  # Hugging Face's rotate_half convention
            half = HEAD_DIM // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

        q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
        v = self.v(x).view(B, S, KV_HEADS, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


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
        dense.q, dense.k, dense.v, dense.o, D_MODEL, HEADS, KV_HEADS, q_norm=dense.q_norm,
        k_norm=dense.k_norm, rope=scaled_rope, tp_group=groups["tp"], cp_group=groups["cp"],
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    assert layer.head_dim == HEAD_DIM and layer.q_bias is not None and layer.o_bias is not None
    fp.distribute(layer, mesh, token_axes=("cp", "tp") if sequence_parallel else ("cp",))
    if sequence_parallel:
        x_local = _to_local(x, groups).requires_grad_()
        y = layer(x_local)
        y.backward(_to_local(g, groups))
        local = {dtype: {"y": _to_local(r["y"], groups), "dx": _to_local(r["dx"], groups)}
                 for dtype, r in refs.items()}  # fmt: skip
    else:  # every TP rank holds the CP shard whole
        x_local = fp.shard_sequence(x, groups["cp"], dim=1).transpose(0, 1).requires_grad_()
        y = layer(x_local)
        y.backward(fp.shard_sequence(g, groups["cp"], dim=1).transpose(0, 1))
        local = {dtype: {name: fp.shard_sequence(r[name], groups["cp"], dim=1).transpose(0, 1)
                         for name in ("y", "dx")} for dtype, r in refs.items()}  # fmt: skip
    for name, got in (("y", y), ("dx", x_local.grad)):
        assert_close(got, local[torch.float64][name], local[torch.float32][name], name=name)
    names = {"q_weight": "q.weight", "k_weight": "k.weight", "v_weight": "v.weight",
             "o_weight": "o.weight", "q_bias": "q.bias", "k_bias": "k.bias", "v_bias": "v.bias",
             "o_bias": "o.bias", "q_norm_weight": "q_norm.weight",
             "k_norm_weight": "k_norm.weight"}  # fmt: skip
    for name, param in layer.named_parameters():
        dense_name = names[name]
        assert_close(param.grad.full_tensor(), refs[torch.float64][dense_name],
                     refs[torch.float32][dense_name], name=name, sum_length=SEQ)  # fmt: skip
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


@pytest.mark.parametrize("build, match", [
    (lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, HEADS, KV_HEADS,
                                                  bias=False),
     r"dense q has a bias but this ParallelAttention was built with bias=False"),
    (lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, HEADS, KV_HEADS,
                                                  o_bias=False),
     r"dense o has a bias .* o_bias=False"),
    (lambda p: fp.nn.ParallelAttention.from_dense(
        *_dense_parts(k=nn.Linear(D_MODEL, KV_HEADS * HEAD_DIM, bias=False)).values(),
        D_MODEL, HEADS, KV_HEADS),
     r"dense k has no bias but this ParallelAttention was built with bias=True"),
    (lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, HEADS, KV_HEADS,
                                                  q_norm=torch.ones(HEAD_DIM)),
     r"k_norm missing but this ParallelAttention was built with qk_norm=True"),
    (lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, HEADS, KV_HEADS,
                                                  head_dim=8),
     r"dense q must be \(32, 32\) \(heads x head_dim 8\), got \(64, 32\)"),
    (lambda p: fp.nn.ParallelAttention.from_dense(*p.values(), D_MODEL, 3, 1),
     r"dense q has 64 rows, not a multiple of n_heads \(3\)"),
    (lambda p: fp.nn.ParallelAttention(D_MODEL, 4, head_dim=7),
     r"head_dim \(7\) must be even"),
    (lambda p: fp.nn.ParallelAttention(30, 4), r"d_model \(30\) is not divisible by n_heads"),
])  # fmt: skip
def test_from_dense_refuses_what_it_would_not_compute(build, match):
    with pytest.raises(ValueError, match=match):
        build(_dense_parts())


def test_a_bad_rope_table_is_refused():
    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, head_dim=HEAD_DIM,
                                    rope=lambda pos: (torch.ones(len(pos), 3),) * 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"cos, sin of \(8, 8\) or \(8, 16\), got \(8, 3\)"):
        layer(torch.randn(8, 1, D_MODEL))


def test_swiglu_refuses_a_bias_it_has_no_place_for():
    gate, up, down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
    with pytest.raises(ValueError, match=r"dense gate has a bias .* bias=False"):
        fp.nn.ParallelSwiGLU.from_dense(gate, up, down, None, bias=False)
    with pytest.raises(ValueError, match=r"dense down has no bias .* bias=True"):
        fp.nn.ParallelSwiGLU.from_dense(gate, up, nn.Linear(16, 8, bias=False), None)
