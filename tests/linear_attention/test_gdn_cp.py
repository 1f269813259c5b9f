"""`fp.gated_delta_rule(..., group=)` on 4 gloo ranks, zigzag and contiguous, against the
single-device op on the whole sequence: the output shard, the final state and every
gradient (q, k, v, g, beta, initial_state).

Every rank builds the whole inputs from the seed, runs the single-device op on them and
the CP op on its shard. In float64 (torch's implementation) they agree to 1e-10
relative: the CP op only regroups the same sums (the maps' fold), so the difference is
rounding at float64's 1e-16 over a few hundred tokens. Under Triton's interpreter in fp32
they agree to 1e-4 relative (fp32's rounding over the chunks, well above its 1e-7).
"""

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.ops.linear_attention_cp import context_parallel_gated_delta
from fusedpar.ops.span_exchange import MeshExchange
from fusedpar.testing import Collectives, exception_of
from fusedpar.testing.strategies import randn
from tests.linear_attention.helpers import NAMES, gdn_inputs, run_with_grads

WORLD = dist.group.WORLD


def _groups(p):
    """(ring group, Ulysses group) of the case: the whole world as a ring, as Ulysses,
    or a (2, 2) mesh."""
    mesh = p.get("mesh", "ring")
    if mesh == "ring":
        return WORLD, None
    if mesh == "ulysses":
        return None, WORLD
    dims = fp.ParallelDims(cp=2, ulysses=2)
    groups = dims.groups(dims.build_mesh("cpu"))
    return groups["cp"], groups["ulysses"]


def _shard(t, layout, groups=(WORLD, None)):
    ring, ulysses = groups
    return None if t is None else fp.shard_sequence(t, ring, layout=layout, ulysses_group=ulysses)


def _summaries_over_mesh(q, k, v, g, beta, *, group, ulysses_group, layout, **options):
    """The summaries over both axes of a (ring, Ulysses) mesh (no head exchange): the
    layer's other mode under the hybrid layout."""
    return context_parallel_gated_delta(
        (q, k, v, g, beta),
        scale=q.shape[-1] ** -0.5,
        initial_state=options["initial_state"],
        cu_seqlens=options["cu_seqlens"],
        want_final=options["output_final_state"],
        group=MeshExchange(group, ulysses_group),
        layout=layout,
    )


def _run(p):
    layout = p["layout"]
    groups = _groups(p)
    inputs = gdn_inputs(
        p["B"],
        p["T"],
        p["Hk"],
        p["group"],
        p["K"],
        p["V"],
        dtype=torch.float64,
        seed=p["seed"],
        per_channel=p["per_channel"],
        documents=p["documents"],
    )
    Hv = p["Hk"] * p["group"]
    do = randn((p["B"], p["T"], Hv, p["V"]), torch.float64, p["seed"] + 7)
    N = p["B"] if p["documents"] is None else len(p["documents"])
    dfinal = randn((N, Hv, p["K"], p["V"]), torch.float64, p["seed"] + 8)
    with fp.implementation("torch"):  # the float64 oracle, whichever path the CP op takes
        full = run_with_grads(fp.gated_delta_rule, inputs, do, dfinal)
    dtype = p["dtype"]
    local = {n: _shard(inputs[n], layout, groups) for n in NAMES[:5]}
    local = {n: t.to(dtype) for n, t in local.items()}
    local["initial_state"] = inputs["initial_state"]
    if local["initial_state"] is not None and dtype != torch.float64:
        local["initial_state"] = local["initial_state"].float()
    local["cu_seqlens"] = inputs["cu_seqlens"]
    assert local["q"].shape[1] * dist.get_world_size() == p["T"]  # a shard, not the whole
    ring, ulysses = groups
    options = dict(group=ring, layout=layout, ulysses_group=ulysses)
    op = _summaries_over_mesh if p.get("over_mesh") else fp.gated_delta_rule
    got = run_with_grads(op, local, _shard(do, layout, groups), dfinal, **options)
    expected = [
        _shard(t, layout, groups) if i in (0, 2, 3, 4, 5, 6) else t for i, t in enumerate(full)
    ]
    for name, mine, want in zip(("o", "final", *NAMES), got, expected, strict=True):
        if want is None:
            assert mine is None, name
            continue
        err = (mine.double() - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= p["rtol"] * scale, (name, err, scale)
    return True


def _case(layout, **overrides):
    p = dict(
        layout=layout,
        B=1,
        T=4 * 2 * 37,
        Hk=1,
        group=2,
        K=8,
        V=6,
        seed=3,
        per_channel=False,
        documents=None,
        dtype=torch.float64,
        rtol=1e-10,
    )
    if layout == "contiguous":
        p["T"] = 4 * 37
    p.update(overrides)
    return p


CASES = {
    # two sequences; spans of 37 tokens (not a multiple of 64)
    "zigzag-batch": _case("zigzag", B=2),
    "contiguous-batch": _case("contiguous", B=2, seed=4),
    # spans of 20 tokens: a document ending exactly at a span boundary, one of 1 token,
    # one crossing three spans, an empty one, and a per-channel gate
    "zigzag-documents": _case("zigzag", T=160, documents=[20, 1, 70, 0, 9, 60], seed=5),
    "contiguous-documents": _case(
        "contiguous", T=160, documents=[40, 1, 100, 19], seed=6, per_channel=True
    ),
    # the heads over Ulysses 4 (Hk 4, Hv 8), and a ring 2 x Ulysses 2 mesh: the
    # summaries over the ring, zigzag spans of 20 tokens split again over Ulysses
    "ulysses-batch": _case("contiguous", mesh="ulysses", B=2, Hk=4, T=4 * 37, seed=7),
    # the same mesh with no head exchange: spans of 10 tokens over all 4 ranks
    "mesh-summaries-documents": _case(
        "zigzag", mesh="hybrid", over_mesh=True, T=80, documents=[20, 1, 30, 29], seed=10
    ),
    "mesh-summaries-contiguous": _case(
        "contiguous", mesh="hybrid", over_mesh=True, B=2, T=4 * 21, seed=11
    ),
    "hybrid-documents": _case(
        "zigzag", mesh="hybrid", Hk=2, T=80, documents=[20, 1, 30, 29], seed=8, per_channel=True
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_gated_delta_rule_cp_matches_single_device(world, name):
    assert all(world(4).run(_run, CASES[name]))


def test_gated_delta_rule_cp_triton_interpreter(world, triton_kernels):
    """The kernels' path (fp32, the interpreter): one zigzag case with documents, against
    the float64 single-device op."""
    p = _case("zigzag", T=8 * 12, documents=[12, 50, 1, 33], dtype=torch.float32, rtol=1e-4)
    p.update(K=4, V=4, seed=9)
    assert all(world(4).run(_run, p))


def _refuse(layout):
    q = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    g = -torch.rand(1, 3, 1, dtype=torch.float64)
    if layout == "ulysses":  # one head over two Ulysses ranks
        return fp.gated_delta_rule(q, q, q, g, -g, ulysses_group=WORLD)
    return fp.gated_delta_rule(q, q, q, g, -g, group=WORLD, layout=layout)


def test_gated_delta_rule_cp_refuses_bad_layouts(world):
    """A zigzag shard of an odd length, an unknown layout, heads that do not divide over
    Ulysses: a clear ValueError on every rank, before any collective."""
    refusals = {
        "zigzag": "two equal spans",
        "ring": "layout must be one of",
        "ulysses": "do not divide by the Ulysses degree 2",
    }
    for layout, words in refusals.items():
        found = world(2).run(exception_of, _refuse, layout)
        assert all(isinstance(e, ValueError) and words in str(e) for e in found), found


def _traffic(T, documents):
    """The collectives of one forward and backward on this rank's shard of T tokens."""
    p = _case("zigzag", T=T, documents=documents)
    inputs = gdn_inputs(1, T, 1, 2, 8, 6, dtype=torch.float64, seed=1, documents=documents)
    local = {n: _shard(inputs[n], "zigzag") for n in NAMES[:5]}
    local["initial_state"], local["cu_seqlens"] = inputs["initial_state"], inputs["cu_seqlens"]
    do = randn((1, T // dist.get_world_size(), 2, 6), torch.float64, 2)
    dfinal = randn(tuple(inputs["initial_state"].shape), torch.float64, 3)
    with Collectives() as seen:
        run_with_grads(fp.gated_delta_rule, local, do, dfinal, group=WORLD, layout=p["layout"])
    return dict(seen.counts), dict(seen.bytes)


def test_gated_delta_rule_cp_sends_summaries_only(world):
    """One all-gather forward (each span's [E, M]) and one backward (each span's D), of
    the same bytes at 8 and 32 tokens a span: nothing proportional to T crosses a rank.
    With documents, the final states and the initial states' gradient (whole on every
    rank) add one all-reduce each."""
    short, long = (world(4).run(_traffic, T, None)[0] for T in (64, 256))
    assert short == long
    assert short[0] == {("all_gather", 4): 2}
    # per rank: 2 spans x Hv 2 x K 8 x ((V + K) for [E, M] and V for D), float64; the
    # count adds the input to the 4 ranks' output (x 5)
    assert short[1][("all_gather", 4)] == 5 * 2 * 2 * 8 * ((6 + 8) + 6) * 8
    packed = world(4).run(_traffic, 64, [5, 50, 9])[0]
    assert packed[0] == {("all_gather", 4): 2, ("all_reduce", 4): 2}
