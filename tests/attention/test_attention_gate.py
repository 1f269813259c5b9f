"""`fp.nn.ParallelAttention`'s output gate (``output_gate=True``: Qwen3-Next's and
Qwen3.5's full-attention layers) and KV heads replicated over TP ranks (TP a multiple of
n_kv_heads): forward, dx and every parameter gradient (DTensor parameters, gathered)
against Hugging Face's ``Qwen3NextAttention`` (tiny random config, every parameter
re-drawn: head q/k norms with Gemma's offset, partial rotary) and a plain float64
module (biases, Llama's full rotary, which the QKV GEMMs join), at one rank, TP2, TP4
with 2 KV heads and TP2 x Ulysses 2 with 1; a checkpoint saved at TP4 with 2 KV heads
loads at TP2 and one rank, and one saved at TP2 at TP4; bad head counts refused before
any collective."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)

import fusedpar as fp
from fusedpar.nn.attention import kv_heads_per_rank
from fusedpar.nn.attention_parts import join_gate, rope_tables, split_gate
from fusedpar.testing import assert_close, exception_of

D_MODEL, HEAD_DIM, SEQ, BATCH = 24, 8, 8, 2  # SEQ: whole tokens on each of 4 TP ranks
NAMES = {  # the layer's parameter -> the dense module's (and which half of a gated q)
    "q_weight": ("q_proj.weight", 0),
    "gate_weight": ("q_proj.weight", 1),
    "q_bias": ("q_proj.bias", 0),
    "gate_bias": ("q_proj.bias", 1),
    "k_weight": ("k_proj.weight", None),
    "v_weight": ("v_proj.weight", None),
    "k_bias": ("k_proj.bias", None),
    "v_bias": ("v_proj.bias", None),
    "o_weight": ("o_proj.weight", None),
    "o_bias": ("o_proj.bias", None),
    "q_norm_weight": ("q_norm.weight", None),
    "k_norm_weight": ("k_norm.weight", None),
}


def _hf_config(heads, kv_heads):
    config = Qwen3NextConfig(
        hidden_size=D_MODEL,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        num_hidden_layers=1,
        attention_bias=False,
    )
    config._attn_implementation = "sdpa"  # causal without a mask
    return config


class HFGated(nn.Module):
    """Hugging Face's Qwen3NextAttention on (B, S, d), with its rotary embedding."""

    def __init__(self, heads, kv_heads):
        super().__init__()
        config = _hf_config(heads, kv_heads)
        self.attn = Qwen3NextAttention(config, 0)
        self.rotary = Qwen3NextRotaryEmbedding(config)

    def forward(self, x):
        tables = self.rotary(x, torch.arange(x.shape[1])[None])
        return self.attn(x, tables, None)[0]


class PlainGated(nn.Module):
    """Gated GQA attention in plain PyTorch: biases everywhere, Llama's full rotary."""

    def __init__(self, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q_proj = nn.Linear(D_MODEL, heads * HEAD_DIM * 2)  # [q_h | gate_h] per head
        self.k_proj = nn.Linear(D_MODEL, kv_heads * HEAD_DIM)
        self.v_proj = nn.Linear(D_MODEL, kv_heads * HEAD_DIM)
        self.o_proj = nn.Linear(heads * HEAD_DIM, D_MODEL)

    def forward(self, x):
        B, S, _ = x.shape
        q, gate = self.q_proj(x).view(B, S, self.heads, 2 * HEAD_DIM).chunk(2, -1)
        k = self.k_proj(x).view(B, S, self.kv_heads, HEAD_DIM)
        v = self.v_proj(x).view(B, S, self.kv_heads, HEAD_DIM).transpose(1, 2)
        cos, sin = rope_tables(torch.arange(S), HEAD_DIM, 10000.0, torch.float64)
        cos, sin = (torch.cat([t, t], -1)[:, None].to(x.dtype) for t in (cos, sin))

        def rotate(t):  # (B, S, H, hd), pairs (i, i + hd/2)
            half = HEAD_DIM // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, S, -1) * torch.sigmoid(gate.reshape(B, S, -1))
        return self.o_proj(out)


def _dense(kind, heads, kv_heads, seed):
    """The dense module, every parameter drawn at random (none zero, none one)."""
    torch.manual_seed(seed)
    module = (HFGated if kind == "hf" else PlainGated)(heads, kv_heads)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.2))
    return module.double()


def _params(module):
    """The dense module's parameters by `NAMES`' names (HF's inside ``attn``)."""
    return {n.removeprefix("attn."): p for n, p in module.named_parameters()}


def _layer(dense, heads, kv_heads, groups, sequence_parallel):
    """The layer of `dense` on `groups` (tp, and cp where the groups have it)."""
    p = _params(dense)
    parts = [p[f"{n}_proj.weight"].float() for n in "qkvo"]
    biases = [p.get(f"{n}_proj.bias") for n in "qkvo"]
    hf = "q_norm.weight" in p
    options = (
        dict(
            q_norm=p["q_norm.weight"].float(),
            k_norm=p["k_norm.weight"].float(),
            norm_offset=1.0,  # Qwen3-Next's zero-centred (1 + weight)
            rope=lambda pos: dense.rotary(torch.zeros(1), pos[None]),
            rotary_dim=HEAD_DIM // 2,
        )
        if hf
        else dict(bias=tuple(None if b is None else b.float() for b in biases))
    )
    return fp.nn.ParallelAttention.from_dense(
        *parts,
        D_MODEL,
        heads,
        kv_heads,
        output_gate=True,
        tp_group=groups["tp"],
        cp_group=groups.get("cp"),
        ulysses_group=groups.get("ulysses"),
        sequence_parallel=sequence_parallel,
        **options,
    )


def _run(kind, heads, kv_heads, sequence_parallel, seed, cp=1, ulysses=1):
    """The layer at CP x Ulysses x TP = the world size against the dense module in
    float64 and fp32 (CP: the zigzag ring; Ulysses: the heads' exchange)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tp = world // (cp * ulysses)
    dims = fp.ParallelDims(cp=cp, ulysses=ulysses, tp=tp)
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    dense = _dense(kind, heads, kv_heads, seed)
    x = torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.float64)
    g = torch.randn(BATCH, SEQ, D_MODEL, dtype=torch.float64)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        module = _dense(kind, heads, kv_heads, seed).to(dtype)
        xd = x.to(dtype, copy=True).requires_grad_()
        y = module(xd)
        y.backward(g.to(dtype))
        grads = {n: t.grad for n, t in _params(module).items()}
        refs[dtype] = {"y": y.detach(), "dx": xd.grad, **grads}
    layer = _layer(dense, heads, kv_heads, groups, sequence_parallel)
    assert layer.kv_replicas == max(1, tp // kv_heads)
    axes = ("cp", "ulysses") if ulysses > 1 else ("cp",)
    fp.distribute(layer, mesh, token_axes=(*axes, "tp") if sequence_parallel else axes)
    rank = fp.comm.group_rank(groups["tp"])

    def local(t):  # (B, S, d) -> this rank's (S / CP / U / TP, B, d) or (S / CP / U, B, d)
        t = fp.shard_sequence(t, groups["cp"], dim=1, ulysses_group=groups.get("ulysses"))
        t = t.transpose(0, 1)
        return t.chunk(tp)[rank] if sequence_parallel else t

    x_local = local(x).float().requires_grad_()
    y = layer(x_local)
    y.backward(local(g).float())
    for name, got in (("y", y), ("dx", x_local.grad)):
        ref = {dtype: local(r[name]) for dtype, r in refs.items()}
        assert_close(got, ref[torch.float64], ref[torch.float32], name=name)
    dense_params = _params(dense)
    for name, param in layer.named_parameters():
        dense_name, half = NAMES[name]
        want = {dtype: r[dense_name] for dtype, r in refs.items()}
        weight = dense_params[dense_name].float()
        if half is not None:  # a gated q's q or gate rows
            want = {dtype: split_gate(t, HEAD_DIM)[half] for dtype, t in want.items()}
            weight = split_gate(weight, HEAD_DIM)[half]
        assert torch.equal(param.full_tensor(), weight), name  # the layer holds the dense
        assert_close(
            param.grad.full_tensor(),
            want[torch.float64],
            want[torch.float32],
            name=name,
            sum_length=SEQ * BATCH,
        )
    return True


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "tp2"])
def test_the_gate_matches_hugging_face_qwen3_next(world, ranks):
    assert all(world(ranks).run(_run, "hf", 4, 2, True, ranks))


def test_the_gate_matches_a_plain_module_at_tp2_classic_tp(world):
    assert all(world(2).run(_run, "plain", 4, 2, False, 3))


def test_the_gate_under_context_parallelism_tp2_cp2(world):
    assert all(world(4).run(_run, "hf", 4, 2, True, 6, cp=2))


@pytest.mark.parametrize("kind, sequence_parallel", [("plain", True), ("hf", False)])
def test_kv_heads_replicated_at_tp4_with_2_kv_heads(world, kind, sequence_parallel):
    """8 query heads, 2 KV heads over TP4: each KV head on 2 ranks, 2 query heads each
    (sequence parallel, and classic TP: the KV gradient partial over TP either way)."""
    assert all(world(4).run(_run, kind, 8, 2, sequence_parallel, 4))


@pytest.mark.parametrize("kind", ["plain", "hf"])
def test_kv_heads_replicated_over_tp_with_ulysses(world, kind):
    """4 query heads, 1 KV head at TP2 x Ulysses 2: the KV head on both TP ranks, and
    again on both Ulysses ranks by the heads' exchange (one query head a rank);
    forward, dx and every gradient against the dense module."""
    assert all(world(4).run(_run, kind, 4, 1, True, 7, 1, 2))


def _built(tp_ranks, seed):
    dims = fp.ParallelDims(tp=tp_ranks)
    mesh = dims.build_mesh("cpu")
    layer = _layer(_dense("plain", 8, 2, seed), 8, 2, dims.groups(mesh), True)
    return fp.distribute(layer, mesh)


def _save(path, seed):
    layer = _built(torch.distributed.get_world_size(), seed)
    fp.checkpoint.save(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


def _load(path, ranks):
    layer = _built(ranks, seed=99)  # other weights, overwritten by the load
    fp.checkpoint.load(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("saved_at, loaded_at", [(4, 2), (4, 1), (2, 4)])
def test_a_checkpoint_of_replicated_kv_heads_loads_at_other_tp(
    world, tmp_path, saved_at, loaded_at
):
    path = str(tmp_path / "step-1")
    saved = world(saved_at).run(_save, path, 5)[0]
    loaded = world(loaded_at).run(_load, path, loaded_at)
    for tensors in loaded:
        assert tensors.keys() == saved.keys()
        for name, t in tensors.items():
            assert torch.equal(t, saved[name]), name


def _build_bad(heads, kv_heads, **options):
    dims = fp.ParallelDims(tp=torch.distributed.get_world_size())
    groups = dims.groups(dims.build_mesh("cpu"))
    fp.nn.ParallelAttention(
        D_MODEL, heads, kv_heads, head_dim=HEAD_DIM, tp_group=groups["tp"], **options
    )


@pytest.mark.parametrize(
    "heads, kv_heads, options, match",
    [
        (12, 3, {}, r"n_kv_heads \(3\) and the TP degree \(4\)"),
        (6, 2, {}, r"n_heads \(6\) is not divisible by the TP degree \(4\)"),
    ],
    ids=["tp-neither-multiple-nor-divisor", "query-heads"],
)
def test_bad_head_counts_are_refused_before_any_collective(world, heads, kv_heads, options, match):
    errors = world(4).run(exception_of, _build_bad, heads, kv_heads, **options)
    for error in errors:
        assert isinstance(error, ValueError) and re.search(match, str(error)), error


def test_head_split_rule():
    assert [kv_heads_per_rank(8, 2, tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="one must divide the other"):
        kv_heads_per_rank(12, 3, 4)


def test_a_gated_q_without_output_gate_is_refused_naming_it():
    dense = _dense("plain", 4, 2, 0).float()
    p = _params(dense)
    with pytest.raises(ValueError, match="pass output_gate=True"):
        fp.nn.ParallelAttention.from_dense(
            *(p[f"{n}_proj.weight"] for n in "qkvo"),
            D_MODEL,
            4,
            2,
            bias=tuple(p[f"{n}_proj.bias"] for n in "qkvo"),
        )
    with pytest.raises(TypeError, match="output_gate must be a bool"):
        fp.nn.AttentionSpec(D_MODEL, 4, 2, output_gate="yes")


def test_split_and_join_gate_are_inverse():
    q = torch.randn(4 * 2 * HEAD_DIM, 5)
    assert torch.equal(join_gate(*split_gate(q, HEAD_DIM), HEAD_DIM), q)
    heads = q.view(4, 2, HEAD_DIM, 5)
    assert torch.equal(split_gate(q, HEAD_DIM)[1].view(4, HEAD_DIM, 5), heads[:, 1])


@pytest.mark.parametrize(
    "options",
    [{"bias": True}, {"qk_norm": "head", "norm_offset": 1.0, "rotary_dim": 4}],
    ids=["bias-rope-in-gemms", "head-norms-partial-rotary"],
)
def test_one_rank_gated_is_one_op_with_the_composed_paths_bits(monkeypatch, options):
    """On one rank the gated layer is one op (`fusedpar::attention_layer` with its gate):
    the output and every gradient are bit for bit the composed path's."""
    from fusedpar.nn import attention

    layer = fp.nn.ParallelAttention(D_MODEL, 4, 2, head_dim=HEAD_DIM, output_gate=True, **options)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):  # re-drawn: biases and norms never trivial
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
    x, dy = (torch.randn(SEQ - 1, BATCH, D_MODEL) for _ in range(2))
    ops = []
    attention_layer = attention.attention_layer
    monkeypatch.setattr(
        attention, "attention_layer", lambda *a, **k: ops.append(1) or attention_layer(*a, **k)
    )

    def run():
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.backward(dy)
        grads = [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return [y, xr.grad, *grads]

    one_op = run()
    assert ops == [1] and layer.gate_weight.grad is None
    monkeypatch.setattr(attention, "takes_one_op", lambda *a: False)
    composed = run()
    assert ops == [1] and len(one_op) == len(composed) == 2 + len(list(layer.parameters()))
    for got, expected in zip(one_op, composed, strict=True):
        assert torch.equal(got, expected)
