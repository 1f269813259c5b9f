"""The TP schedules' choice (`fusedpar.ops.linear.resolve_overlap`): ``overlap=`` on the
ops and layers, else ``FUSEDPAR_OVERLAP`` read at the call, else "auto" by its rule; the
collectives each schedule runs; "fused" and typos refused on every rank before any
collective. (Each schedule against float64, forward and every gradient, at W = 2 and 4:
tests/tp/test_tensor_parallel.py, whose drawn ``chunks`` 0 is the serial schedule.)"""

import os

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.ops.overlap import resolve_overlap
from fusedpar.testing import Collectives, exception_of

WORLD = dist.group.WORLD


def _counts(overlap, env):
    """The collectives of an all-gather GEMM and a reduce-scatter GEMM, forward and
    backward, under `overlap` with ``FUSEDPAR_OVERLAP`` set to `env` (None: unset)."""
    if env is None:
        os.environ.pop("FUSEDPAR_OVERLAP", None)
    else:
        os.environ["FUSEDPAR_OVERLAP"] = env
    try:
        W = dist.get_world_size()
        x = torch.randn(3, 8, requires_grad=True)
        w1, w2 = torch.randn(4, 8, requires_grad=True), torch.randn(5, 4, requires_grad=True)
        with Collectives() as seen:
            y = fp.matmul_reduce_scatter(
                fp.all_gather_matmul(x, w1, WORLD, overlap=overlap), w2, WORLD, overlap=overlap
            )
        forward = dict(seen.counts)
        with Collectives() as seen:
            y.sum().backward()
        return {"forward": forward, "backward": dict(seen.counts), "W": W}
    finally:
        os.environ.pop("FUSEDPAR_OVERLAP", None)


@pytest.mark.parametrize(
    "overlap, env, schedule",
    [
        ("serial", None, "serial"),
        ("ring", "serial", "ring"),  # the argument beats the variable
        (None, "serial", "serial"),  # the variable, read at the call
        (None, None, "ring"),  # auto on gloo: the ring
        ("auto", "serial", "ring"),
    ],
)
def test_each_schedule_runs_its_collectives(world, overlap, env, schedule):
    for got in world(4).run(_counts, overlap, env):
        W = got["W"]
        if schedule == "serial":  # one all-gather, one reduce-scatter each way
            assert got["forward"] == {("all_gather", W): 1, ("reduce_scatter", W): 1}
            assert got["backward"] == {("all_gather", W): 2, ("reduce_scatter", W): 1}
        else:  # W - 1 ring steps each (and the dW re-gather beside dX's ring)
            assert got["forward"] == {("send", W): 2 * (W - 1), ("recv", W): 2 * (W - 1)}
            assert got["backward"][("send", W)] == 2 * (W - 1)
            assert ("reduce_scatter", W) not in got["backward"]


def _refused(overlap, env):
    os.environ["FUSEDPAR_OVERLAP"] = env or ""
    try:
        x, w = torch.randn(3, 8), torch.randn(4, 8)
        with Collectives() as seen:
            error = exception_of(fp.all_gather_matmul, x, w, WORLD, overlap=overlap)
        return type(error).__name__, str(error), dict(seen.counts)
    finally:
        os.environ.pop("FUSEDPAR_OVERLAP", None)


@pytest.mark.parametrize(
    "overlap, env, match",
    [
        ("fused", None, r"overlap='fused' .* cannot run here: .* this group is gloo"),
        (None, "fused", r"overlap='fused'"),
        ("rings", None, r"overlap must be one of 'auto', 'serial', 'ring', 'fused', got 'rings'"),
        (None, "Serial", r"FUSEDPAR_OVERLAP must be one of .* got 'Serial'"),
    ],
)
def test_fused_and_typos_are_refused_on_every_rank_before_any_collective(
    world, overlap, env, match
):
    for kind, message, counts in world(2).run(_refused, overlap, env):
        assert kind == "ValueError" and counts == {}
        assert __import__("re").search(match, message), message


def test_layers_refuse_a_typo_when_built_and_one_rank_resolves_anything():
    for make in (
        lambda: fp.nn.ColumnParallelLinear(4, 4, overlap="serial "),
        lambda: fp.nn.RowParallelLinear(4, 4, overlap="Ring"),
        lambda: fp.nn.ParallelSwiGLU(4, 8, overlap="fast"),
        lambda: fp.nn.ParallelAttention(8, 2, overlap="overlap"),
    ):
        with pytest.raises(ValueError, match="overlap must be None or one of"):
            make()
    assert resolve_overlap("auto", None) == "serial"  # no group: nothing to schedule
    layer = fp.nn.RowParallelLinear(4, 3, overlap="serial")
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


# --- reduce_dtype: the partial sums travel in it -------------------------------------------


def _reduced(overlap, reduce_dtype):
    """matmul_reduce_scatter's output and all_gather_matmul's dX (its backward's
    reduce-scatter) with fp32 operands and the partials travelling in `reduce_dtype`,
    against float64: each within (W + 1) roundings to `reduce_dtype` of the sum of the
    ranks' |partials| (a partial or running sum is rounded once per hop), and not equal
    to the fp32 reduction's result (the option took effect)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    T, K, N, D = 4 * W, 6, 5, 7
    X, Wt = torch.randn(T, K * W, generator=gen), torch.randn(N, K * W, generator=gen)
    b = torch.randn(N, generator=gen)
    Xc, W2, dY = (
        torch.randn(T, D, generator=gen),
        torch.randn(K * W, D, generator=gen),
        torch.randn(T, K * W, generator=gen),
    )
    cols, rows = slice(rank * K, (rank + 1) * K), slice(rank * 4, (rank + 1) * 4)
    results = {}
    for rd in (None, reduce_dtype):
        y = fp.matmul_reduce_scatter(
            X[:, cols].clone(), Wt[:, cols].clone(), WORLD, bias=b, overlap=overlap, reduce_dtype=rd
        )
        xs = Xc[rows].clone().requires_grad_()
        out = fp.all_gather_matmul(xs, W2[cols].clone(), WORLD, overlap=overlap, reduce_dtype=rd)
        out.backward(dY[:, cols])
        results[rd] = (y, xs.grad)
    each = [slice(r * K, (r + 1) * K) for r in range(W)]
    parts = [X[:, c].double() @ Wt[:, c].double().T for c in each]
    dparts = [dY[:, c].double() @ W2[c].double() for c in each]
    eps, ok = torch.finfo(reduce_dtype).eps, []
    for got, ref, ps in (
        (results[reduce_dtype][0], sum(parts)[rows] + b.double(), parts),
        (results[reduce_dtype][1], sum(dparts)[rows], dparts),
    ):
        scale = sum(p.abs() for p in ps)[rows]
        ok.append(bool(((got.double() - ref).abs() <= (W + 1) * eps * scale + 1e-5).all()))
    ok += [not torch.equal(results[None][i], results[reduce_dtype][i]) for i in (0, 1)]
    return ok


@pytest.mark.parametrize("overlap", ["serial", "ring"])
@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16])
def test_partial_sums_travel_in_reduce_dtype(world, overlap, reduce_dtype):
    for ok in world(4).run(_reduced, overlap, reduce_dtype):
        assert ok == [True] * 4


def test_a_bad_reduce_dtype_is_a_type_error():
    x, w = torch.randn(3, 4), torch.randn(2, 4)
    for bad in (torch.int32, "bfloat16"):
        with pytest.raises(TypeError, match="reduce_dtype must be None or a floating"):
            fp.matmul_reduce_scatter(x, w, None, reduce_dtype=bad)
        with pytest.raises(TypeError, match="reduce_dtype must be None or a floating"):
            fp.nn.RowParallelLinear(4, 2, reduce_dtype=bad)


# --- "auto" measured per shape ----------------------------------------------------------


def _auto_measured():
    """Two calls of an all-gather GEMM under "auto" with the measuring switched on (it
    times only on GPUs): the pick made on the first call, agreed, and the collectives of
    the second (the picked schedule's alone)."""
    from fusedpar.kernels import tuning

    from fusedpar.ops import overlap

    saved, overlap.measures = overlap.measures, lambda device: True
    try:
        rank, W = dist.get_rank(), dist.get_world_size()
        gen = torch.Generator().manual_seed(3)
        X, w = torch.randn(13 * W, 12, generator=gen), torch.randn(7, 12, generator=gen)
        x = X[13 * rank : 13 * (rank + 1)]
        with Collectives() as first:
            y = fp.all_gather_matmul(x, w, WORLD, overlap="auto")
        picks = {
            key: c.kwargs["overlap"]
            for (_, key), c in tuning.tuner("tp_schedule").picks.items()
            if key[:3] == ("all_gather_matmul", W, 16) and key[3] == 12
        }
        with Collectives() as second:
            again = fp.all_gather_matmul(x, w, WORLD, overlap="auto")
        torch.testing.assert_close(y.double(), X.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        assert torch.equal(y, again)
        return list(picks.values()), dict(first.counts), dict(second.counts)
    finally:
        overlap.measures = saved


def test_auto_times_each_candidate_once_per_shape_and_agrees(world):
    from fusedpar.ops.overlap import AUTO_CANDIDATES, measures

    assert not measures(torch.device("cpu"))  # CPU ranks take the rule (the test above)
    results = world(2).run(_auto_measured)
    picks = [r[0] for r in results]
    assert len(picks[0]) == 1 and picks[0][0] in AUTO_CANDIDATES and picks[0] == picks[1]
    first, second = results[0][1], results[0][2]
    if picks[0][0] == "serial":
        assert second == {("all_gather", 2): 1}
    else:
        assert second == {("send", 2): 1, ("recv", 2): 1}
    # the first call: the serial reference, each candidate 1 + 3 times and once checked,
    # one sum of the times, then the pick's own run
    serial = picks[0][0] == "serial"
    assert first == {
        ("all_gather", 2): 1 + 5 + serial,
        ("send", 2): 5 + (not serial),
        ("recv", 2): 5 + (not serial),
        ("all_reduce", 2): 1,
    }, first
