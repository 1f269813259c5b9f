"""`fp.nn.ParallelMLA` (DeepSeek-V3's multi-head latent attention) against a plain
PyTorch float64 reference written from Hugging Face's `DeepseekV3Attention`: the output
and every parameter's gradient, with and without q's latent, biases, interleaved rotary
pairs; Triton's kernels too (V of its own head dim in the attention kernels). The
layer under TP, CP and Hugging Face's checkpoints: tests/hf/test_hf.py (deepseek_v3)."""

import pytest
import torch
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.nn.attention_parts import rope_tables
from fusedpar.nn.mla import ParallelMLA
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn

D_MODEL, HEADS, NOPE, ROPE, V_DIM, KV_LORA, EPS = 32, 4, 16, 8, 8, 24, 1e-6


def _rms(x, w):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w


def _rotate(x, cos, sin, interleaved):
    """Hugging Face's rotation of x (B, S, H, r): pairs (i, i + r/2), or (2i, 2i + 1)."""
    c, s = cos[None, :, None], sin[None, :, None]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_reference(x, p, q_lora, interleaved, scale):
    """Hugging Face's MLA forward, x (S, B, d) -> (S, B, d), causal; `p`: its weights."""
    xb = x.transpose(0, 1)
    B, S, _ = xb.shape
    if q_lora:
        q = F.linear(_rms(F.linear(xb, p["q_a"], p.get("q_a_b")), p["q_a_norm"]), p["q_b"])
    else:
        q = F.linear(xb, p["q"])
    q_nope, q_rope = q.view(B, S, HEADS, NOPE + ROPE).split([NOPE, ROPE], dim=-1)
    latent, k_rope = F.linear(xb, p["kv_a"], p.get("kv_a_b")).split([KV_LORA, ROPE], dim=-1)
    kv = F.linear(_rms(latent, p["kv_a_norm"]), p["kv_b"]).view(B, S, HEADS, NOPE + V_DIM)
    k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
    cos, sin = (t.to(x.dtype) for t in rope_tables(torch.arange(S), ROPE, 10000.0, torch.float64))
    q_rope = _rotate(q_rope, cos, sin, interleaved)
    k_rope = _rotate(k_rope.view(B, S, 1, ROPE), cos, sin, interleaved).expand(-1, -1, HEADS, -1)
    q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, HEADS * V_DIM)
    return F.linear(out, p["o"], p.get("o_b")).transpose(0, 1)


def _dense(q_lora, bias, seed):
    """Hugging Face's weights (out, in), every one random (norms and biases too)."""
    shapes = {
        "kv_a": (KV_LORA + ROPE, D_MODEL),
        "kv_a_norm": (KV_LORA,),
        "kv_b": (HEADS * (NOPE + V_DIM), KV_LORA),
        "o": (D_MODEL, HEADS * V_DIM),
    }
    if q_lora:
        shapes |= {
            "q_a": (q_lora, D_MODEL),
            "q_a_norm": (q_lora,),
            "q_b": (HEADS * (NOPE + ROPE), q_lora),
        }
    else:
        shapes["q"] = (HEADS * (NOPE + ROPE), D_MODEL)
    if bias:
        shapes |= {"kv_a_b": (KV_LORA + ROPE,), "o_b": (D_MODEL,)}
        if q_lora:
            shapes["q_a_b"] = (q_lora,)
    return {
        n: randn(s, torch.float64, seed + i, scale=0.3, exact_in=torch.float32)
        for i, (n, s) in enumerate(shapes.items())
    }


# our parameter -> (Hugging Face's weight name, whose rows `dense_rows` maps back)
NAMES = {
    "q_a_weight": "q_a",
    "q_a_bias": "q_a_b",
    "q_a_norm_weight": "q_a_norm",
    "q_b_weight": "q_b",
    "q_weight": "q",
    "kv_a_weight": "kv_a",
    "kv_a_bias": "kv_a_b",
    "kv_a_norm_weight": "kv_a_norm",
    "kv_b_weight": "kv_b",
    "o_weight": "o",
    "o_bias": "o_b",
}


@pytest.mark.parametrize(
    "q_lora, bias, interleaved, implementation",
    [
        (16, False, True, "auto"),  # DeepSeek-V3's: q's latent, interleaved rotary pairs
        (None, True, False, "auto"),  # V2-Lite's: q_proj, biases
        (16, True, False, "triton"),  # the attention kernels with Dv != Dqk (the interpreter)
    ],
)
def test_mla_matches_float64(q_lora, bias, interleaved, implementation):
    check_mla(q_lora, bias, interleaved, implementation, 11, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_gpu(interleaved):
    """The layer's kernels compiled (bf16), a longer sequence."""
    check_mla(16, True, interleaved, "triton", 300, "cuda", torch.bfloat16)


def check_mla(q_lora, bias, interleaved, implementation, S, device, dtype):
    dense = _dense(q_lora, bias, seed=3)
    scale = 0.7 * (NOPE + ROPE) ** -0.5  # (a YaRN mscale^2 stand-in)
    x = randn((S, 2, D_MODEL), torch.float64, 0, exact_in=dtype)
    dy = randn((S, 2, D_MODEL), torch.float64, 1, exact_in=dtype)
    dense = {n: t.to(dtype).double() for n, t in dense.items()}  # exact in dtype

    def reference(dtype):
        p = {n: t.to(dtype).clone().requires_grad_() for n, t in dense.items()}
        y = mla_reference(x.to(dtype), p, q_lora, interleaved, scale)
        (y * dy.to(dtype)).sum().backward()
        return y.detach(), {n: t.grad for n, t in p.items()}

    ref64, ref32 = reference(torch.float64), reference(dtype)
    q = tuple(_linear(dense, n) for n in ("q_a", "q_b")) if q_lora else _linear(dense, "q")
    layer = ParallelMLA.from_dense(
        q,
        _linear(dense, "kv_a"),
        _linear(dense, "kv_b"),
        _linear(dense, "o"),
        D_MODEL,
        HEADS,
        q_a_norm=dense.get("q_a_norm"),
        kv_a_norm=dense["kv_a_norm"],
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        softmax_scale=scale,
        norm_eps=EPS,
        rope_interleave=interleaved,
        dtype=dtype,
        device=device,
    )
    with fp.implementation(implementation):
        y = layer(x.to(device, dtype))
        (y * dy.to(device, dtype)).sum().backward()
    assert_close(y.cpu(), ref64[0], ref32[0], name="output", sum_length=D_MODEL)
    for name, param in layer.named_parameters():
        grad = layer.dense_rows(name, param.grad.cpu(), interleaved)
        assert_close(
            grad, ref64[1][NAMES[name]], ref32[1][NAMES[name]], name=name, sum_length=D_MODEL
        )


def _linear(dense, name):
    """`nn.Linear` of `dense[name]` (with its bias where there is one)."""
    weight, bias = dense[name], dense.get(f"{name}_b")
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.float()


def test_bad_configurations_are_refused():
    common = dict(
        q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
    )
    with pytest.raises(ValueError, match="qk_rope_head_dim \\(7\\) must be even"):
        ParallelMLA(32, 4, **{**common, "qk_rope_head_dim": 7})
    with pytest.raises(TypeError, match="rope must be"):
        ParallelMLA(32, 4, **common, rope=False)
    layer = ParallelMLA(32, 4, **common)
    with pytest.raises(ValueError, match="takes x \\(S_loc, B, d_model=32\\)"):
        layer(torch.zeros(3, 1, 16))


def _run_ring(cp_ring, seed):
    """This rank's ParallelMLA over a ring of the world (zigzag): its output shard, every
    gradient summed over the ring (each rank's is its own tokens' share), whether the
    latent travels, and the bytes the ring's sends moved."""
    import torch.distributed as dist

    from fusedpar.testing import Collectives

    dense = _dense(16, True, seed)
    group = dist.group.WORLD
    q = tuple(_linear(dense, n) for n in ("q_a", "q_b"))
    layer = ParallelMLA.from_dense(
        q,
        _linear(dense, "kv_a"),
        _linear(dense, "kv_b"),
        _linear(dense, "o"),
        D_MODEL,
        HEADS,
        q_a_norm=dense["q_a_norm"],
        kv_a_norm=dense["kv_a_norm"],
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        norm_eps=EPS,
        rope_interleave=True,
        cp_group=group,
        cp_ring=cp_ring,
        dtype=torch.float32,
    )
    x, dy = (
        fp.shard_sequence(randn((16, 2, D_MODEL), torch.float32, seed + i), group, dim=0)
        for i in (10, 11)
    )
    with Collectives() as seen:
        y = layer(x)
        (y * dy).sum().backward()
    grads = {}
    for name, param in layer.named_parameters():
        grads[name] = param.grad.clone()
        dist.all_reduce(grads[name])
    sent = sum(n for (kind, _), n in seen.bytes.items() if kind == "send")
    return y.detach(), grads, layer.latent_ring(x), sent


def test_the_latent_ring_computes_the_expanded_rings_numbers(world):
    """The latent ring (DeepSeek-V3's latent and shared rotary head travel, each step
    expands them) against the ring of expanded heads on 4 ranks: the same output and
    summed gradients (fp32, the same math: only the GEMMs' blocking differs), at a
    quarter of the bytes here (a token's latent, 24 + 8 values, against its 4 heads'
    K and V, 4 x (24 + 8)). On a CPU `cp_ring="auto"` keeps the expanded heads (measured
    faster there: ParallelMLA's comment)."""
    latent = world(4).run(_run_ring, "latent", 5)
    expanded = world(4).run(_run_ring, "auto", 5)
    for (y, grads, took_latent, sent), (y_ref, grads_ref, took_ref, sent_ref) in zip(
        latent, expanded, strict=True
    ):
        assert took_latent and not took_ref
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_ref[name], rtol=1e-5, atol=1e-5, msg=name)
        assert sent * HEADS == sent_ref > 0


def _odd_ring():
    """A zigzag ring over a sequence its 2W chunks do not split (3 tokens a rank)."""
    import torch.distributed as dist

    from fusedpar.ops.mla_ring import mla_ring_attn

    q = torch.zeros(1, 3, HEADS, NOPE + ROPE)
    latent, w = torch.zeros(1, 3, KV_LORA + ROPE), torch.zeros(HEADS * (NOPE + V_DIM), KV_LORA)
    mla_ring_attn(
        q, latent, w, dist.group.WORLD, qk_nope_head_dim=NOPE, v_head_dim=V_DIM, softmax_scale=0.1
    )


def test_the_latent_ring_refuses_what_it_cannot_split_on_every_rank(world):
    from fusedpar.testing import exception_of

    for e in world(2).run(exception_of, _odd_ring):
        assert isinstance(e, ValueError) and "must be divisible by 4" in str(e), repr(e)
