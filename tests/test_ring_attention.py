"""fp.ring_attn and the sequence helpers against full-sequence attention, at W = 2 and 4.

Every rank builds the full q, k, v and upstream gradients from the seed, shards them,
runs the ring, and checks its shard of the output, LSE and every gradient against the
float64 reference (tolerance rule of DESIGN) and against single-device `flash_attn`.
"""

import re

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels.attention import attention_reference
from fusedpar.kernels.attention_merge import merge_attention
from hypothesis import example, given
from hypothesis import strategies as st
from test_attention import attention_grads, torch_results  # noqa: I001 (a sibling test module)

import fusedpar as fp
from fusedpar.testing import WorldError, assert_close
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

WORLD = dist.group.WORLD


def _full_inputs(p, size):
    S = p["chunk"] * (2 * size if p["layout"] == "zigzag" else size)
    Hq = p["Hkv"] * p["group"]
    exact = {"exact_in": p["dtype"]}  # the oracle sees exactly what the ring sees
    q = randn((p["B"], S, Hq, p["D"]), torch.float64, p["seed"], **exact)
    k = randn((p["B"], S, p["Hkv"], p["D"]), torch.float64, p["seed"] + 1, **exact)
    v = randn((p["B"], S, p["Hkv"], p["D"]), torch.float64, p["seed"] + 2, **exact)
    dout = randn((p["B"], S, Hq, p["D"]), torch.float64, p["seed"] + 3, **exact)
    dlse = randn((p["B"], Hq, S), torch.float64, p["seed"] + 4, exact_in=torch.float32)
    return q, k, v, dout, dlse


def _run_ring(p):
    size, dtype, layout, causal = dist.get_world_size(), p["dtype"], p["layout"], p["causal"]
    q, k, v, dout, dlse = _full_inputs(p, size)

    def shard(t, dim=1):
        return fp.shard_sequence(t, WORLD, dim=dim, layout=layout)

    local = [shard(t).to(dtype) for t in (q, k, v)]

    def ring(*t):
        return fp.ring_attn(*t, WORLD, causal=causal, layout=layout, return_lse=True)

    got = attention_grads(ring, local, shard(dout), shard(dlse, dim=2))

    def shard_all(full):
        return [shard(t, dim=2 if i == 1 else 1) for i, t in enumerate(full)]

    full = [t.to(dtype) for t in (q, k, v)]
    ref64 = attention_grads(lambda *t: attention_reference(*t, causal=causal), (q, k, v), dout,
                            dlse)  # fmt: skip
    same = torch_results(full, dout, dlse, ref64, causal)
    single = attention_grads(
        lambda *t: fp.flash_attn(*t, causal=causal, return_lse=True), full, dout, dlse
    )
    expected = zip(*map(shard_all, (ref64, same, single)), strict=True)
    for name, g, (r, t, s) in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == s.dtype, name
        assert_close(g, r, t, name=name, sum_length=p["D"] if name.startswith("d") else None)
    # gathered, the output is the full-sequence one
    gathered = fp.gather_sequence(got[0], WORLD, layout=layout)
    assert_close(gathered, ref64[0], same[0], name="gathered out")
    return True


@given(
    world_size=st.sampled_from([2, 4]), B=st.integers(1, 2), chunk=st.integers(1, 9),
    Hkv=st.integers(1, 2), group=st.integers(1, 3), D=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(), layout=st.sampled_from(["zigzag", "contiguous"]),
    dtype=cpu_dtypes(), seed=seeds(),
)  # fmt: skip
@example(world_size=4, B=1, chunk=1, Hkv=1, group=4, D=16, causal=True, layout="zigzag",
         dtype=torch.float32, seed=0)  # one token per chunk, MQA  # fmt: skip
@example(world_size=2, B=2, chunk=7, Hkv=2, group=2, D=40, causal=True, layout="contiguous",
         dtype=torch.float16, seed=1)  # fmt: skip
def test_ring_attn_matches_full_attention(world, world_size, **p):
    assert all(world(world_size).run(_run_ring, p))


def _run_no_key_rows_and_single_rank_equality(layout):
    """Rows with nothing to see never produce NaN; and a world of one is flash_attn."""
    q = randn((1, 8, 2, 16), torch.float32, 0)
    k, v = randn((1, 8, 1, 16), torch.float32, 1), randn((1, 8, 1, 16), torch.float32, 2)
    out = fp.ring_attn(q, k, v, WORLD, causal=True, layout=layout)
    return bool(torch.isfinite(out).all())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_outputs_are_finite(world, layout):
    assert all(world(4).run(_run_no_key_rows_and_single_rank_equality, layout))


@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_is_flash_attn(world, causal):
    q = randn((2, 6, 4, 16), torch.float32, 0)
    k, v = randn((2, 6, 2, 16), torch.float32, 1), randn((2, 6, 2, 16), torch.float32, 2)
    expected = fp.flash_attn(q, k, v, causal=causal)
    assert torch.equal(fp.ring_attn(q, k, v, None, causal=causal), expected)
    assert torch.equal(world(1).run(_ring_on_world, q, k, v, causal)[0], expected)


def _ring_on_world(q, k, v, causal):
    return fp.ring_attn(q, k, v, WORLD, causal=causal)


# --- sequence helpers -----------------------------------------------------------------


def _run_helpers(layout, seq_len):
    rank, size = dist.get_rank(), dist.get_world_size()
    chunk = seq_len // (2 * size if layout == "zigzag" else size)

    def owned(r):
        return [r, 2 * size - 1 - r] if layout == "zigzag" else [r]

    x = torch.arange(seq_len * 3, dtype=torch.float32).view(1, seq_len, 3).requires_grad_()
    local = fp.shard_sequence(x, WORLD, layout=layout)
    positions = fp.sequence_positions(seq_len, WORLD, layout=layout)
    expected = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in owned(rank)])
    full = fp.gather_sequence(local, WORLD, layout=layout)
    # rank r's loss weighs its tokens by r + 1; shard's backward gathers, so every rank
    # gets the full gradient: r + 1 at the positions rank r holds
    (local * (rank + 1)).sum().backward()
    per_position = torch.empty(seq_len)
    for r in range(size):
        for c in owned(r):
            per_position[c * chunk : (c + 1) * chunk] = r + 1
    return (
        torch.equal(positions, expected)
        and torch.equal(local[0, :, 0], positions.float() * 3)
        and torch.equal(full, x.detach())
        and torch.equal(x.grad[0, :, 0], per_position)
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_gather_positions_agree(world, world_size, layout):
    assert all(world(world_size).run(_run_helpers, layout, 8 * world_size))


def _run_gather_backward(layout):
    local = torch.randn(1, 4, 2, requires_grad=True)
    full = fp.gather_sequence(local, WORLD, layout=layout)
    grad = torch.arange(full.numel(), dtype=torch.float32).view_as(full)
    full.backward(grad)
    return torch.equal(local.grad, fp.shard_sequence(grad, WORLD, layout=layout))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_gather_backward_keeps_the_local_part(world, layout):
    assert all(world(2).run(_run_gather_backward, layout))


def test_helpers_without_a_group_are_identities():
    x = torch.randn(2, 5, 3)
    assert fp.shard_sequence(x, None) is x and fp.gather_sequence(x, None) is x
    assert torch.equal(fp.sequence_positions(5, None), torch.arange(5))


# --- the merge kernel ---------------------------------------------------------------------


def test_merge_is_exact_symmetric_and_nan_free():
    B, S, H, D = 2, 5, 3, 24
    oa, ob = randn((B, S, H, D), torch.float32, 0), randn((B, S, H, D), torch.float32, 1)
    la, lb = randn((B, H, S), torch.float32, 2), randn((B, H, S), torch.float32, 3)
    la[0, 0, :2] = float("-inf")  # side a empty on two rows
    lb[0, 0, 1:3] = float("-inf")  # side b empty on two rows: row 1 empty on both
    oa[0, :2, 0] = 0
    ob[0, 1:3, 0] = 0

    def merged(o1, l1, o2, l2):
        out, lse = o1.clone(), l1.clone()
        merge_attention(out, lse, o2, l2)
        return out, lse

    out_ab, lse_ab = merged(oa, la, ob, lb)
    out_ba, lse_ba = merged(ob, lb, oa, la)
    torch.testing.assert_close(out_ab, out_ba, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_ab, lse_ba, rtol=0, atol=0)
    # float64 reference
    l64 = torch.logaddexp(la.double(), lb.double())
    w_a = torch.exp(la.double() - l64).nan_to_num(0).transpose(1, 2)[..., None]
    w_b = torch.exp(lb.double() - l64).nan_to_num(0).transpose(1, 2)[..., None]
    o64 = oa.double() * w_a + ob.double() * w_b
    torch.testing.assert_close(out_ab.double(), o64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_ab.double(), l64, rtol=1e-6, atol=1e-6)
    # one side empty: the other passes through exactly; both empty: 0 and -inf
    assert torch.equal(out_ab[0, 0, 0], ob[0, 0, 0]) and torch.equal(lse_ab[0, 0, 0], lb[0, 0, 0])
    assert torch.equal(out_ab[0, 2, 0], oa[0, 2, 0]) and torch.equal(lse_ab[0, 0, 2], la[0, 0, 2])
    assert torch.equal(out_ab[0, 1, 0], torch.zeros(D)) and lse_ab[0, 0, 1] == float("-inf")
    assert not torch.isnan(out_ab).any()


# --- bad input ----------------------------------------------------------------------------


def _run_bad(case):
    rank = dist.get_rank()
    S = {"odd zigzag": 3, "ranks disagree": 4 + 2 * rank}.get(case, 4)
    q = torch.ones(1, S, 2, 8)
    k = torch.ones(1, S + (1 if case == "q/k lengths" else 0), 2, 8)
    layout = "spiral" if case == "layout" else "zigzag"
    fp.ring_attn(q, k, k, WORLD, causal=True, layout=layout)


@pytest.mark.parametrize(
    "case, match",
    [("odd zigzag", r"2W = 4.*3 tokens"), ("layout", "spiral"),
     ("q/k lengths", "4 local tokens.*5"), ("ranks disagree", "disagree")],
)  # fmt: skip
def test_bad_input_fails_on_every_rank(world, case, match):
    with pytest.raises(WorldError) as info:
        world(2).run(_run_bad, case)
    assert sorted(info.value.exceptions) == [0, 1]
    for e in info.value.exceptions.values():
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def test_helper_bad_lengths():
    with pytest.raises(ValueError, match="layout"):
        fp.sequence_positions(8, None, layout="spiral")
