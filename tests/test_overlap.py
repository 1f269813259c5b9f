"""The TP schedules' choice (`fusedpar.ops.linear.resolve_overlap`): ``overlap=`` on the
ops and layers, else ``FUSEDPAR_OVERLAP`` read at the call, else "auto" by its rule; the
collectives each schedule runs; "fused" and typos refused on every rank before any
collective. (Each schedule against float64, forward and every gradient, at W = 2 and 4:
tests/test_tensor_parallel.py, whose drawn ``chunks`` 0 is the serial schedule.)"""

import os

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.ops.linear import resolve_overlap
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
            y = fp.matmul_reduce_scatter(fp.all_gather_matmul(x, w1, WORLD, overlap=overlap),
                                         w2, WORLD, overlap=overlap)  # fmt: skip
        forward = dict(seen.counts)
        with Collectives() as seen:
            y.sum().backward()
        return {"forward": forward, "backward": dict(seen.counts), "W": W}
    finally:
        os.environ.pop("FUSEDPAR_OVERLAP", None)


@pytest.mark.parametrize("overlap, env, schedule", [
    ("serial", None, "serial"),
    ("ring", "serial", "ring"),  # the argument beats the variable
    (None, "serial", "serial"),  # the variable, read at the call
    (None, None, "ring"),  # auto on gloo: the ring
    ("auto", "serial", "ring"),
])  # fmt: skip
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


@pytest.mark.parametrize("overlap, env, match", [
    ("fused", None, r"overlap='fused' .* not available .* this group is gloo"),
    (None, "fused", r"overlap='fused'"),
    ("rings", None, r"overlap must be one of 'auto', 'serial', 'ring', 'fused', got 'rings'"),
    (None, "Serial", r"FUSEDPAR_OVERLAP must be one of .* got 'Serial'"),
])  # fmt: skip
def test_fused_and_typos_are_refused_on_every_rank_before_any_collective(world, overlap, env,
                                                                         match):  # fmt: skip
    for kind, message, counts in world(2).run(_refused, overlap, env):
        assert kind == "ValueError" and counts == {}
        assert __import__("re").search(match, message), message


def test_layers_refuse_a_typo_when_built_and_one_rank_resolves_anything():
    for make in (lambda: fp.nn.ColumnParallelLinear(4, 4, overlap="serial "),
                 lambda: fp.nn.RowParallelLinear(4, 4, overlap="Ring"),
                 lambda: fp.nn.ParallelSwiGLU(4, 8, overlap="fast"),
                 lambda: fp.nn.ParallelAttention(8, 2, overlap="overlap")):  # fmt: skip
        with pytest.raises(ValueError, match="overlap must be None or one of"):
            make()
    assert resolve_overlap("auto", None) == "serial"  # no group: nothing to schedule
    layer = fp.nn.RowParallelLinear(4, 3, overlap="serial")
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
