"""Attention sinks (gpt-oss: a learned logit per query head in every row's softmax
denominator, with no value) in all four entry points: `flash_attn`, `flash_attn_varlen`,
`ring_attn` (and its hybrid with Ulysses) and `ulysses_attn`. Output, LSE, dQ, dK, dV
and d(sinks) against the float64 reference with the sink as one more key column; rows
that see no key give 0 (LSE = the sink), never NaN; under the ring the sink enters once.
"""

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.attention import AttentionMask, attention_reference, visible_reference

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn


def _inputs(B, Sq, Skv, Hq, Hkv, D, dtype, seed, Dv=None):
    """Float64 q, k, v (of head dim `Dv`, None: D), dout, dlse exact in `dtype`, and
    float32 sinks."""
    exact = {"exact_in": dtype}
    Dv = D if Dv is None else Dv
    q = randn((B, Sq, Hq, D), torch.float64, seed, **exact)
    k = randn((B, Skv, Hkv, D), torch.float64, seed + 1, **exact)
    v = randn((B, Skv, Hkv, Dv), torch.float64, seed + 2, **exact)
    dout = randn((B, Sq, Hq, Dv), torch.float64, seed + 3, **exact)
    dlse = randn((B, Hq, Sq), torch.float64, seed + 4, exact_in=torch.float32)
    sinks = 2 * randn((Hq,), torch.float32, seed + 5)
    return q, k, v, dout, dlse, sinks


def _grads(fn, q, k, v, sinks, dout, dlse):
    """[out, lse, dq, dk, dv, dsinks] of <out, dout> + <lse, dlse> through fn."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = fn(*leaves)
    loss = (out * dout.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
    return [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]


def _check(got, ref64, same, D, what):
    for name, g, r, t in zip(
        ("out", "lse", "dq", "dk", "dv", "dsinks"), got, ref64, same, strict=True
    ):
        assert torch.isfinite(g).all(), f"{what}: {name} not finite"
        assert_close(g, r, t, name=f"{what}: {name}", sum_length=D)


def _expected(inputs, dtype, **mask):
    """The float64 reference and PyTorch's own in `dtype` (the tolerance rule's yardstick)."""
    q, k, v, dout, dlse, sinks = inputs
    visible = mask.pop("visible", None)

    def reference(q, k, v, s):
        return attention_reference(q, k, v, AttentionMask(sinks=s, **mask), visible)

    ref64 = _grads(reference, q, k, v, sinks.double(), dout, dlse)
    same = _grads(reference, *(t.to(dtype) for t in (q, k, v)), sinks, dout, dlse)
    return ref64, same


@pytest.mark.parametrize(
    "Sq, Skv, causal, window, dtype, Dv",
    [
        (13, 13, True, (-1, -1), torch.float32, None),
        (9, 17, False, (3, 2), torch.float16, 8),  # V narrower than Q and K
        (11, 5, True, (-1, -1), torch.float32, None),  # bottom-right: the first 6 rows see no key
    ],
)
def test_flash_attn_sinks_match_float64(each_implementation, Sq, Skv, causal, window, dtype, Dv):
    inputs = _inputs(2, Sq, Skv, 4, 2, 16, dtype, seed=Sq + Skv, Dv=Dv)
    q, k, v, dout, dlse, sinks = inputs
    mask = dict(causal=causal, window=window)
    got = _grads(
        lambda *t: fp.flash_attn(*t[:3], sinks=t[3], return_lse=True, **mask),
        *(t.to(dtype) for t in (q, k, v)),
        sinks,
        dout,
        dlse,
    )
    _check(got, *_expected(inputs, dtype, **mask), 16, "flash_attn")
    if Sq > Skv:  # rows with no key: out 0, LSE the sink
        empty = Sq - Skv
        assert torch.equal(got[0][:, :empty], torch.zeros_like(got[0][:, :empty]))
        assert torch.equal(got[1][..., :empty], sinks[None, :, None].expand(2, 4, empty))


def test_flash_attn_varlen_sinks_match_float64(each_implementation):
    cu = torch.tensor([0, 5, 5, 12, 19], dtype=torch.int32)  # an empty document too
    inputs = _inputs(1, 19, 19, 4, 1, 8, torch.float32, seed=7)
    q, k, v, dout, dlse, sinks = inputs
    visible = visible_reference(cu, cu, causal=True, window=(4, 0))

    def varlen(q, k, v, s):
        out, lse = fp.flash_attn_varlen(
            q[0], k[0], v[0], cu, causal=True, window=(4, 0), sinks=s, return_lse=True
        )
        return out[None], lse[None]

    got = _grads(varlen, *(t.float() for t in (q, k, v)), sinks, dout, dlse)
    _check(got, *_expected(inputs, torch.float32, visible=visible), 8, "flash_attn_varlen")


def _run_sharded(kind, seed):
    """ring (2 ranks, zigzag), ulysses (2 ranks) or hybrid (2 x 2): this rank's shard of
    every output and gradient; d(sinks) summed over the ranks (each holds some rows)."""
    world = dist.get_world_size()
    ring_group = ulysses_group = None
    if kind == "hybrid":
        dims = fp.ParallelDims(cp=2, ulysses=2)
        groups = dims.groups(dims.build_mesh("cpu"))
        ring_group, ulysses_group = groups["cp"], groups["ulysses"]
    elif kind == "ring":
        ring_group = dist.group.WORLD
    else:
        ulysses_group = dist.group.WORLD
    layout = "contiguous" if kind == "ulysses" else "zigzag"
    S, D, dtype = 4 * world, 8, torch.float32
    inputs = _inputs(2, S, S, 4, 2, D, dtype, seed)
    q, k, v, dout, dlse, sinks = inputs
    mask = dict(causal=True, window=(5, 0))

    def shard(t, dim=1):
        return fp.shard_sequence(t, ring_group, dim=dim, layout=layout, ulysses_group=ulysses_group)

    def attend(q, k, v, s):
        if kind == "ulysses":
            return fp.ulysses_attn(q, k, v, ulysses_group, sinks=s, return_lse=True, **mask)
        return fp.ring_attn(
            q,
            k,
            v,
            ring_group,
            layout=layout,
            ulysses_group=ulysses_group,
            sinks=s,
            return_lse=True,
            **mask,
        )

    got = _grads(
        attend, *(shard(t.float()) for t in (q, k, v)), sinks, shard(dout), shard(dlse, dim=2)
    )
    dist.all_reduce(got[5])
    ref64, same = _expected(inputs, dtype, **mask)

    def local(results):
        return [shard(t, dim=2 if i == 1 else 1) if i < 5 else t for i, t in enumerate(results)]

    _check(got, local(ref64), local(same), D, kind)
    return True


@pytest.mark.parametrize("kind, ranks", [("ring", 2), ("ulysses", 2), ("hybrid", 4)])
def test_sharded_attention_sinks_match_float64(world, kind, ranks):
    assert all(world(ranks).run(_run_sharded, kind, 3))


@pytest.mark.parametrize(
    "sinks, error, match",
    [
        (torch.zeros(3), ValueError, r"sinks must be float32 \(4,\) \(one logit per query head\)"),
        (torch.zeros(4, dtype=torch.float64), ValueError, r"got torch.float64 \(4,\)"),
        ([0.0] * 4, TypeError, r"sinks must be a tensor"),
    ],
)
def test_bad_sinks_raise(sinks, error, match):
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(error, match=match):
        fp.flash_attn(q, q, q, sinks=sinks)
