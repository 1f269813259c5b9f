"""`ParallelAttention.from_dense(..., rope_layout="interleaved")`: a checkpoint whose RoPE
rotates adjacent pairs (2i, 2i + 1) (Meta's, torchtitan's) converted exactly. The
reference is that attention in float64, written here as Meta's `apply_rotary_emb` does
it (a complex multiplication of adjacent pairs), with q/k biases, q/k norms (per head or
over all heads), partial rotary and GQA: the converted layer's output, dx and every
parameter gradient (mapped back by `half_to_interleaved`) at TP2 x CP2 and on one
process; and the layouts' refusals."""

import pytest
import torch
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.nn.attention import half_to_interleaved, interleaved_to_half
from fusedpar.testing import assert_close

D_MODEL, HEADS, KV_HEADS, SEQ, BATCH = 32, 4, 2, 16, 2
CASES = {  # head_dim, rotary_dim, q/k norm, biases, rope_theta
    "head norms, biases, partial rotary": (16, 8, "head", True, 5e5),
    "norms over all heads, full rotary": (8, 8, "full", False, 1e4),
}


def _dense(case: str, seed: int) -> dict:
    """The checkpoint's tensors, in Meta's layout (q/k rows pairing (2i, 2i + 1))."""
    hd, _, norm, bias, _ = CASES[case]
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (HEADS * hd, D_MODEL),
        "k": (KV_HEADS * hd, D_MODEL),
        "v": (KV_HEADS * hd, D_MODEL),
        "o": (D_MODEL, HEADS * hd),
    }
    if bias:
        shapes |= {f"{n}_bias": (shapes[n][0],) for n in "qkvo"}
    if norm is not None:
        full = norm == "full"
        shapes |= {
            "q_norm": (HEADS * hd if full else hd,),
            "k_norm": (KV_HEADS * hd if full else hd,),
        }
    tensors = {n: torch.randn(shape, generator=g) * 0.3 for n, shape in shapes.items()}
    for n in ("q_norm", "k_norm"):
        if n in tensors:
            tensors[n] += 1.0
    return tensors


def _meta_attention(p: dict, x: torch.Tensor, case: str) -> torch.Tensor:
    """Meta's / torchtitan's attention of x (B, S, d) in x's dtype: RMSNorm of q and k
    (per head or over all heads), RoPE as a complex multiplication of adjacent pairs of
    the first rotary_dim dims, causal GQA."""
    hd, r, norm, _, theta = CASES[case]
    B, S, _ = x.shape
    q = F.linear(x, p["q"], p.get("q_bias")).view(B, S, HEADS, hd)
    k = F.linear(x, p["k"], p.get("k_bias")).view(B, S, KV_HEADS, hd)
    v = F.linear(x, p["v"], p.get("v_bias")).view(B, S, KV_HEADS, hd)

    def rms(t, w):  # over the last dim, or all heads' (norm "full")
        flat = t.flatten(-2) if norm == "full" else t
        out = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6) * w
        return out.view(t.shape)

    def rotate(t):  # torchtitan's apply_rotary_emb, on the first r dims
        freqs = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
        angles = torch.arange(S, dtype=torch.float64)[:, None] * freqs  # (S, r/2)
        cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
        pairs = torch.view_as_complex(t[..., :r].reshape(*t.shape[:-1], r // 2, 2).contiguous())
        turned = torch.view_as_real(pairs * cis.to(pairs.dtype)).flatten(-2)
        return torch.cat([turned, t[..., r:]], dim=-1)

    if norm is not None:
        q, k = rms(q, p["q_norm"]), rms(k, p["k_norm"])
    q, k, v = (t.transpose(1, 2) for t in (rotate(q), rotate(k), v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.linear(out.transpose(1, 2).reshape(B, S, -1), p["o"], p.get("o_bias"))


def _convert(p: dict, case: str, groups: dict, **kwargs):
    hd, r, _, bias, theta = CASES[case]
    biases = {"bias": tuple(p[f"{n}_bias"] for n in "qkvo")} if bias else {}
    norms = {n: p[n] for n in ("q_norm", "k_norm") if n in p}
    return fp.nn.ParallelAttention.from_dense(
        p["q"],
        p["k"],
        p["v"],
        p["o"],
        D_MODEL,
        HEADS,
        KV_HEADS,
        rotary_dim=r,
        rope_theta=theta,
        tp_group=groups["tp"],
        cp_group=groups["cp"],
        **biases,
        **norms,
        **kwargs,
    )


def _run_layout(case: str, seed: int) -> bool:
    """TP2 x CP2 on 4 ranks (parameters distributed); one process with every group None."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dims = fp.ParallelDims(cp=2, tp=2) if world == 4 else None
    mesh = dims.build_mesh("cpu") if dims else None
    groups = dims.groups(mesh) if dims else {"tp": None, "cp": None}
    dense = _dense(case, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(BATCH, SEQ, D_MODEL, generator=g) for _ in range(2))
    refs = {}
    for dtype in (torch.float64, torch.float32):
        p = {n: t.to(dtype).requires_grad_() for n, t in dense.items()}
        xd = x.to(dtype).requires_grad_()
        y = _meta_attention(p, xd, case)
        y.backward(dy.to(dtype))
        refs[dtype] = {"y": y.detach(), "dx": xd.grad, **{n: t.grad for n, t in p.items()}}

    layer = _convert(dense, case, groups, rope_layout="interleaved")
    if dims:
        fp.distribute(layer, mesh)

    def local(t):  # (B, S, d) -> this rank's (S / CP / TP, B, d)
        t = fp.shard_sequence(t, groups["cp"], dim=1).transpose(0, 1)
        return t.chunk(fp.comm.group_size(groups["tp"]))[fp.comm.group_rank(groups["tp"])]

    x_local = local(x).detach().requires_grad_()
    y = layer(x_local)
    y.backward(local(dy))
    for name, got in (("y", y), ("dx", x_local.grad)):
        assert_close(
            got, local(refs[torch.float64][name]), local(refs[torch.float32][name]), name=name
        )
    hd, r = CASES[case][:2]
    for name, param in layer.named_parameters():
        grad = param.grad.full_tensor() if dims else param.grad
        dense_name = name.removesuffix("_weight")
        if name[0] in "qk":  # the layer's q/k rows are in its own layout: map them back
            grad = half_to_interleaved(grad, hd, r)
        assert_close(
            grad,
            refs[torch.float64][dense_name],
            refs[torch.float32][dense_name],
            name=name,
            sum_length=SEQ,
        )
    return True


def test_an_interleaved_checkpoint_at_tp2_cp2(world):
    assert world(4).run(_run_layout, "head norms, biases, partial rotary", 0) == [True] * 4


@pytest.mark.parametrize("case", list(CASES))
def test_an_interleaved_checkpoint_in_one_process(case):
    assert _run_layout(case, 1)


def test_the_layout_is_a_permutation_of_each_heads_rows():
    """interleaved -> half is the rows of Hugging Face's Llama conversion (its `permute`);
    the default layout loads the rows as given."""
    p = _dense("head norms, biases, partial rotary", 2)
    hd, r = CASES["head norms, biases, partial rotary"][:2]
    w = p["q"]
    # Hugging Face's convert_llama_weights_to_hf.permute, on the rotary dims of each head
    rotary = w.view(HEADS, hd, D_MODEL)[:, :r]
    hf = rotary.reshape(HEADS, r // 2, 2, D_MODEL).transpose(1, 2).reshape(HEADS, r, D_MODEL)
    expected = torch.cat([hf, w.view(HEADS, hd, D_MODEL)[:, r:]], dim=1).reshape(w.shape)
    assert torch.equal(interleaved_to_half(w, hd, r), expected)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, hd, r), hd, r), w)
    case, groups, rows = "head norms, biases, partial rotary", {"tp": None, "cp": None}, "qk"
    half = {
        n: interleaved_to_half(t, hd, r) if n[0] in rows and n[1:] in ("", "_bias", "_norm") else t
        for n, t in p.items()
    }
    by_hand = _convert(half, case, groups)
    converted = _convert(p, case, groups, rope_layout="interleaved")
    default = _convert(half, case, groups, rope_layout="half")
    for (name, a), b, c in zip(
        by_hand.named_parameters(), converted.parameters(), default.parameters(), strict=True
    ):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_bad_layouts_are_refused():
    p = _dense("head norms, biases, partial rotary", 0)
    case, groups = "head norms, biases, partial rotary", {"tp": None, "cp": None}
    with pytest.raises(
        ValueError,
        match=r"rope_layout must be one of \('half', 'interleaved'\), "
        r"got 'meta'",
    ):
        _convert(p, case, groups, rope_layout="meta")
    with pytest.raises(ValueError, match=r"rope_layout='interleaved' with rope=None"):
        fp.nn.ParallelAttention.from_dense(
            p["q"],
            p["k"],
            p["v"],
            p["o"],
            D_MODEL,
            HEADS,
            KV_HEADS,
            rope=None,
            rope_layout="interleaved",
            bias=tuple(p[f"{n}_bias"] for n in "qkvo"),
            q_norm=p["q_norm"],
            k_norm=p["k_norm"],
        )
    with pytest.raises(ValueError, match=r"dim 0 of \(20, 3\) is not a multiple of head_dim 16"):
        interleaved_to_half(torch.ones(20, 3), 16)
    with pytest.raises(ValueError, match=r"rotary_dim \(6\) must be even and in \(0, head_dim 4\]"):
        half_to_interleaved(torch.ones(8), 4, 6)


def test_a_table_with_each_angle_twice_in_a_row_is_refused():
    """A (S, r) table in the interleaved convention (GPT-J's repeat_interleave) would pass
    for Hugging Face's layout, its first half read as the angles."""

    def interleaved_table(positions):
        angles = positions.double()[:, None] / 10000.0 ** (torch.arange(0, 8, 2) / 8)
        angles = angles.repeat_interleave(2, dim=-1)  # each angle twice in a row
        return angles.cos(), angles.sin()

    layer = fp.nn.ParallelAttention(D_MODEL, HEADS, KV_HEADS, rope=interleaved_table)
    with pytest.raises(ValueError, match=r"\(8, 8\) tables whose halves differ.*t\[:, ::2\]"):
        layer(torch.randn(8, 1, D_MODEL))
    # ahead of a compile, whose traced calls skip it (parallelize runs it at conversion)
    with pytest.raises(ValueError, match=r"\(4, 8\) tables whose halves differ"):
        layer.check_rope_layout()
