"""Helpers of the tests in this folder (moved from test_ring_attention.py)."""

import torch
from fusedpar.kernels.attention import AttentionMask, attention_reference

import fusedpar as fp
from fusedpar.testing import assert_close
from fusedpar.testing.strategies import randn
from tests.attention.helpers import attention_grads, torch_results


def sequence_inputs(p, S):
    """Float64 q, k, v, dout, dlse of the whole sequence (S tokens, p["Hq"] query heads),
    exact in p["dtype"]. Shared with the Ulysses tests."""
    Hq = p["Hq"]
    exact = {"exact_in": p["dtype"]}  # the oracle sees exactly what the ranks see
    q = randn((p["B"], S, Hq, p["D"]), torch.float64, p["seed"], **exact)
    k = randn((p["B"], S, p["Hkv"], p["D"]), torch.float64, p["seed"] + 1, **exact)
    Dv = p.get("Dv") or p["D"]  # V's head dim (None or absent: D)
    v = randn((p["B"], S, p["Hkv"], Dv), torch.float64, p["seed"] + 2, **exact)
    dout = randn((p["B"], S, Hq, Dv), torch.float64, p["seed"] + 3, **exact)
    dlse = randn((p["B"], Hq, S), torch.float64, p["seed"] + 4, exact_in=torch.float32)
    return q, k, v, dout, dlse


def check_sharded_attention(p, ring_group, ulysses_group, layout):
    """Run the ring (`ring_group` > 1 rank), the hybrid (with `ulysses_group`) or Ulysses
    (`ring_group` None) on this rank's shards of a p["tokens"]-per-rank sequence and
    check its output, LSE and every gradient, the gathered output and the positions
    against the float64 reference (tolerance rule of DESIGN) and single-device
    `flash_attn`. Shared with the Ulysses tests; returns (single, shard, got)."""
    ring, ulysses = fp.comm.group_size(ring_group), fp.comm.group_size(ulysses_group)
    S = p["tokens"] * ring * ulysses
    dtype, causal = p["dtype"], p["causal"]
    q, k, v, dout, dlse = sequence_inputs(p, S)
    where = dict(layout=layout, ulysses_group=ulysses_group)

    def shard(t, dim=1):
        return fp.shard_sequence(t, ring_group, dim=dim, **where)

    if ring > 1:  # the hybrid

        def attend(*t):  # noqa: E306
            return fp.ring_attn(
                *t,
                ring_group,
                causal=causal,
                return_lse=True,
                **where,
                deterministic=p.get("deterministic", False),
            )
    else:

        def attend(*t):  # noqa: E306
            return fp.ulysses_attn(*t, ulysses_group, causal=causal, return_lse=True)

    local = [shard(t).to(dtype) for t in (q, k, v)]
    got = attention_grads(attend, local, shard(dout), shard(dlse, dim=2))
    full = [t.to(dtype) for t in (q, k, v)]
    ref64 = attention_grads(
        lambda *t: attention_reference(*t, AttentionMask(causal)), (q, k, v), dout, dlse
    )
    same = torch_results(full, dout, dlse, ref64, causal)
    single = attention_grads(
        lambda *t: fp.flash_attn(*t, causal=causal, return_lse=True), full, dout, dlse
    )

    def shard_all(results):
        return [shard(t, dim=2 if i == 1 else 1) for i, t in enumerate(results)]

    expected = zip(*map(shard_all, (ref64, same, single)), strict=True)
    for name, g, (r, t, s) in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert g.dtype == s.dtype and g.shape == s.shape, name
        # dK, dV of a replicated head: P/Hkv more sums, over the replicas
        length = max(p["D"], v.shape[-1])
        assert_close(g, r, t, name=name, sum_length=length if name.startswith("d") else None)
    gathered = fp.gather_sequence(got[0], ring_group, **where)
    assert_close(gathered, ref64[0], same[0], name="gathered out")
    positions = fp.sequence_positions(S, ring_group, **where)
    assert torch.equal(positions, shard(torch.arange(S)[None])[0])
    return single, shard, got
