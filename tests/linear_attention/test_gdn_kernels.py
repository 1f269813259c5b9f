"""The chunked gated delta rule's Triton launchers (`fusedpar.kernels.linear_attention.chunk`,
`chunk_backward`) in the interpreter against the float64 token loop: the output, the
final state and every gradient, under the tolerance rule (PyTorch's own error: the same
loop in the op's dtype). Shapes are tiny and odd (T = 1, 63, 64, 65, 130; K, V not
powers of 2), with GVA, per-channel decays, packed documents, initial and final states
and strided inputs; gates mix near-0 and very negative (-20) decays, beta has both signs.
"""

import pytest
import torch
import torch.nn.functional as F
import triton
from fusedpar.kernels.linear_attention import chunk as gdn_chunk
from fusedpar.kernels.linear_attention import chunk_backward as gdn_chunk_backward
from fusedpar.kernels.linear_attention.chunk import CHUNK, chunk_gated_delta_forward
from fusedpar.kernels.linear_attention.chunk_backward import chunk_gated_delta_backward
from fusedpar.kernels.linear_attention.reference import gated_delta_rule_reference

from fusedpar.testing.strategies import randn
from fusedpar.testing.tolerance import assert_close

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dinit")


def make_inputs(B, T, Hk, group, K, V, *, seed, per_channel=False, documents=None, h0=True):
    """float64 q, k (unit norm per head), v, g (30% of gates down to -20, the rest near 0),
    beta in (-0.5, 2), initial state, cu_seqlens, and the gradients dO, dfinal."""
    Hv, wide = Hk * group, torch.float64
    gen = torch.Generator().manual_seed(seed)
    shape = (B, T, Hv, K) if per_channel else (B, T, Hv)
    depth = torch.where(torch.rand(shape, generator=gen, dtype=wide) < 0.3, 20.0, 0.05)
    N = B if documents is None else len(documents)
    cu = None
    if documents is not None:
        cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": randn((B, T, Hk, K), wide, seed + 1),
        "k": F.normalize(randn((B, T, Hk, K), wide, seed + 2), dim=-1),
        "v": randn((B, T, Hv, V), wide, seed + 3),
        "g": -torch.rand(shape, generator=gen, dtype=wide) * depth,
        "beta": 2.5 * torch.rand((B, T, Hv), generator=gen, dtype=wide) - 0.5,
        "initial_state": randn((N, Hv, K, V), wide, seed + 4) if h0 else None,
        "cu_seqlens": cu,
        "do": randn((B, T, Hv, V), wide, seed + 5),
        "dfinal": randn((N, Hv, K, V), wide, seed + 6),
    }


def time_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (B, T, ...) as the transpose of a (T, B, ...) tensor: batch and time strided."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def chunked_torch(q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """The kernels' math (64-token chunks, the WY form) in plain PyTorch in q's dtype, by
    chunk and document: its error against the float64 loop is PyTorch's own for this
    algorithm (the triangular solve amplifies rounding that the token loop never meets)."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2:]
    q, k = (t.repeat_interleave(Hv // Hk, 2) for t in (q * scale, k))  # (B, T, Hv, K)
    g = g[..., None].expand(B, T, Hv, K) if g.dim() == 3 else g
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    spans = (
        [(b, 0, T) for b in range(B)]
        if cu_seqlens is None
        else [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    rows, finals = [[] for _ in range(B)], []
    for n, (b, s, e) in enumerate(spans):
        S = q.new_zeros((Hv, K, V)) if initial_state is None else initial_state[n].to(q.dtype)
        for c0 in range(s, e, CHUNK):
            qc, kc, vc, gc = (t[b, c0 : min(c0 + CHUNK, e)].transpose(0, 1) for t in (q, k, v, g))
            bc = beta[b, c0 : min(c0 + CHUNK, e)].T[..., None]  # (Hv, L, 1)
            G, L = gc.cumsum(1), qc.shape[1]
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            diff = G[:, :, None] - G[:, None, :]  # (Hv, L, L, K)
            E = torch.exp(torch.where(causal[..., None], diff, -torch.inf))
            gram = torch.einsum("hik,hjk,hijk->hij", kc, kc, E) * ~torch.eye(L, dtype=torch.bool)
            eye = torch.eye(L, dtype=q.dtype)
            Tm = torch.linalg.solve_triangular(eye + bc * gram, eye, upper=False)
            U = Tm @ (bc * vc) - Tm @ (bc * kc * G.exp()) @ S
            M = torch.einsum("hik,hjk,hijk->hij", qc, kc, E)
            rows[b].append(((qc * G.exp()) @ S + M @ U).transpose(0, 1))
            GL = G[:, -1]  # (Hv, K)
            S = GL.exp()[..., None] * S + (kc * (GL[:, None] - G).exp()).transpose(1, 2) @ U
        finals.append(S)
    return torch.stack([torch.cat(r) for r in rows]), torch.stack(finals)


def reference(x: dict, dtype: torch.dtype, run=None):
    """`run` (the float64 loop by default) in `dtype`: (o, final, gradients by autograd)."""
    names = ("q", "k", "v", "g", "beta")
    ins = {n: x[n].to(dtype).requires_grad_() for n in names}
    h0 = x["initial_state"]
    h0 = None if h0 is None else h0.to(dtype).requires_grad_()
    scale, cu = x["q"].shape[-1] ** -0.5, x["cu_seqlens"]
    if run is None:
        o, final = gated_delta_rule_reference(
            *ins.values(), scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu
        )
    else:
        o, final = run(*ins.values(), scale=scale, initial_state=h0, cu_seqlens=cu)
    loss = (o * x["do"].to(dtype)).sum() + (final * x["dfinal"].to(dtype)).sum()
    leaves = [*ins.values(), *([h0] if h0 is not None else [])]
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), final.detach(), grads


def check(x: dict, dtype: torch.dtype, layout=None, dfinal=True):
    """The launchers on `x` in `dtype` (q, k, v, g, beta, dO; states fp32) against the
    float64 loop, with the same loop in `dtype` as PyTorch's error."""
    layout = layout or (lambda t: t)
    # the float64 loop sees the op's very inputs: its error is the op's alone
    exact = ("q", "k", "v", "g", "beta", "do")
    x = {**x, **{n: x[n].to(dtype).double() for n in exact}}
    x["initial_state"] = None if x["initial_state"] is None else x["initial_state"].float().double()
    x["dfinal"] = x["dfinal"].float().double()
    ins = {n: layout(x[n].to(dtype)) for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"]
    h0 = None if h0 is None else h0.float()
    kwargs = {"scale": x["q"].shape[-1] ** -0.5, "initial_state": h0, "cu_seqlens": x["cu_seqlens"]}
    o, final = chunk_gated_delta_forward(*ins.values(), **kwargs)
    dfin = x["dfinal"].float() if dfinal else None
    grads = chunk_gated_delta_backward(layout(x["do"].to(dtype)), dfin, *ins.values(), **kwargs)
    if not dfinal:
        x = {**x, "dfinal": torch.zeros_like(x["dfinal"])}
    ref_o, ref_final, ref_grads = reference(x, torch.float64)
    # PyTorch's error: the chunked math in fp32; for fp16 inputs, the token loop in fp16
    # (the kernels round the dots' operands to fp16, as a 16-bit PyTorch run would)
    if dtype == torch.float32:
        tor_o, tor_final, tor_grads = reference(x, torch.float32, chunked_torch)
    else:
        tor_o, tor_final, tor_grads = reference(x, dtype)
    assert o.dtype == dtype and final.dtype == torch.float32
    # the chunks' sums run over 64 tokens, the loop's over one: the floor of such dots
    assert_close(o, ref_o, tor_o.to(dtype), name="o", sum_length=CHUNK)
    assert_close(final, ref_final, tor_final.float(), name="final_state", sum_length=CHUNK)
    if h0 is None:
        assert grads[-1] is None
        grads = grads[:-1]
    for name, got, ref, tor in zip(GRADS[: len(grads)], grads, ref_grads, tor_grads, strict=True):
        want = torch.float32 if name == "dinit" else dtype
        assert got.dtype == want and got.shape == ref.shape, name
        assert_close(got, ref, tor.to(want), name=name, sum_length=CHUNK)


@pytest.mark.parametrize(
    ("T", "group", "K", "V"), [(1, 1, 16, 16), (63, 2, 16, 32), (64, 1, 32, 16), (65, 2, 24, 40)]
)
def test_chunk_boundaries_fp32(T, group, K, V):
    """One token, a chunk less one, one, and one more; GVA; K, V unequal and not powers
    of 2 (V = 40 spans two V tiles of the gradient kernel)."""
    check(make_inputs(1, T, 1, group, K, V, seed=T), torch.float32)


def test_two_chunks_batched_strided_fp32():
    """B = 2, T = 130 (three chunks), GVA over two key heads, time-major q, k, v, g,
    beta and dO (batch and time strided): no copies, the strides go to the kernels."""
    check(make_inputs(2, 130, 2, 2, 16, 16, seed=7), torch.float32, layout=time_major)


def test_per_channel_decay_fp32():
    """KDA's per-channel gates (B, T, Hv, K) over two chunks, with GVA."""
    check(make_inputs(1, 70, 1, 2, 16, 16, seed=12, per_channel=True), torch.float32)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per-channel"])
def test_packed_documents_fp32(per_channel):
    """Packed documents of 1, 0, 63 and 66 tokens: the state restarts at each, one initial
    and one final state per document, and chunks never cross a document start."""
    x = make_inputs(
        1, 130, 1, 1, 16, 16, seed=13, per_channel=per_channel, documents=[1, 0, 63, 66]
    )
    check(x, torch.float32)


def test_no_states_fp16():
    """fp16 q, k, v, g, beta: outputs and gradients in fp16, the final state in fp32; no
    initial state (dinit None) and no final-state gradient."""
    check(make_inputs(1, 65, 1, 2, 16, 16, seed=17, h0=False), torch.float16, dfinal=False)


def test_bad_inputs_raise_before_launch():
    x = make_inputs(1, 8, 2, 1, 16, 16, seed=19)  # Hk = Hv = 2
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_forward(
            q,
            k,
            v[:, :, :1].expand(1, 8, 3, 16),
            g[..., :1].expand(1, 8, 3),
            beta[..., :1].expand(1, 8, 3),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_forward(q, k, v, g, beta[..., :1], scale=1.0)
    with pytest.raises(ValueError, match="head dims up to 256"):
        big = torch.zeros(1, 8, 2, 272)
        chunk_gated_delta_forward(q, k, big, g, beta, scale=1.0)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_forward(q, k, v, g, beta, scale=1.0, initial_state=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        cu = torch.tensor([0, 8], dtype=torch.int64)
        chunk_gated_delta_forward(q, k, v, g, beta, scale=1.0, cu_seqlens=cu)
    with pytest.raises(TypeError, match="q and k"):
        chunk_gated_delta_forward(q, k.half(), v, g, beta, scale=1.0)
    with pytest.raises(ValueError, match="do"):
        chunk_gated_delta_backward(v[:, :4], None, q, k, v, g, beta, scale=1.0)
    assert gdn_chunk.CHUNK == 64


def test_guarded_transposes_fp32(monkeypatch):
    """The backward's path for Triton 3.4-3.7.0 (dM and dA transposed through memory, not
    by ``tl.dot(tl.trans(acc), x)``, which those versions miscompile on Hopper)."""
    monkeypatch.setattr(gdn_chunk_backward, "TRANSPOSE_VIA_MEMORY", True)
    check(make_inputs(1, 65, 1, 2, 16, 16, seed=23), torch.float32)


@pytest.mark.parametrize(("T", "per_channel"), [(70, False), (30, True)], ids=["scalar", "kda"])
def test_key_blocks_fp32(monkeypatch, T, per_channel):
    """K = 40 in blocks of 16 (two full, one partial) in both gradient kernels: the
    state-side kernel's K grid axis and the chunk-local kernel's K loops (the shipped
    tiles take K <= 128 in one block there, and 32 at a time here). Per channel, one
    chunk: the interpreter runs its channel loops slowly."""
    blocks = [triton.Config({"BK": 16, "BV": 16}, num_warps=4, num_stages=1)]
    monkeypatch.setattr(gdn_chunk_backward, "state_grads_configs", lambda K, V: blocks)
    monkeypatch.setattr(gdn_chunk_backward, "grads_configs", lambda K, V: blocks)
    check(make_inputs(1, T, 1, 2, 40, 24, seed=29, per_channel=per_channel), torch.float32)


def test_deep_gate_keeps_fp32_precision():
    """A scalar gate of -300 early in each chunk, near 0 elsewhere: the decays are segment
    sums (each its own running sum), not differences of cumulative sums, so the later
    tokens keep fp32's precision (with differences: o, dg, dbeta ~4e-5 relative, PyTorch's
    chunked fp32 the same; segment sums ~4e-7)."""
    x = make_inputs(1, 70, 1, 2, 16, 16, seed=31)
    g = -0.01 * torch.rand_like(x["g"])
    g[:, 3::CHUNK] = -300.0
    x["g"] = g
    ins = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].float()
    x = {**x, **{n: t.double() for n, t in ins.items()}, "initial_state": h0.double()}
    kwargs = {"scale": 16**-0.5, "initial_state": h0, "cu_seqlens": None}
    o, final = chunk_gated_delta_forward(*ins.values(), **kwargs)
    dfinal = x["dfinal"].float()
    grads = chunk_gated_delta_backward(x["do"].float(), dfinal, *ins.values(), **kwargs)
    x["do"], x["dfinal"] = x["do"].float().double(), dfinal.double()
    ref_o, ref_final, ref_grads = reference(x, torch.float64)
    for name, got, ref in zip(
        ("o", "final", *GRADS), (o, final, *grads), (ref_o, ref_final, *ref_grads), strict=True
    ):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 3e-6, (name, err)
