"""The tuner behind every launcher: buckets, restores, agreement over a group, frozen loops.

On CPU the launchers offer one interpreter tile per key, so these tests drive `Tuner`
with stand-in launches (sleeps) where several candidates are needed, and the launchers
themselves where the keys and the loops are the point.
"""

import time

import pytest
import torch
import torch.distributed as dist
import triton
from fusedpar.kernels import tuning
from fusedpar.kernels.matmul import matmul

import fusedpar as fp
from fusedpar.testing import WorldError
from fusedpar.testing.strategies import randn

# The kernels' own tuning and tiles: Triton's kernels (the interpreter here).
pytestmark = pytest.mark.usefixtures("triton_kernels")

CPU = torch.device("cpu")
CONFIGS = [triton.Config({"BLOCK_M": 16}), triton.Config({"BLOCK_M": 32})]


def candidates():
    return CONFIGS


def _sleepy(ms_per_config, calls):
    def launch(config):
        calls.append(config.kwargs["BLOCK_M"])
        time.sleep(ms_per_config[config.kwargs["BLOCK_M"]] / 1e3)

    return launch


@pytest.fixture(autouse=True)
def clean_picks(monkeypatch):
    for name in ("FUSEDPAR_TUNING", "FUSEDPAR_TUNING_CACHE"):  # the tests set their own
        monkeypatch.delenv(name, raising=False)
    tuning.forget_picks()
    yield
    tuning.forget_picks()


def test_times_every_candidate_once_then_reuses_the_pick():
    tuner, calls = tuning.Tuner("t"), []
    launch = _sleepy({16: 20, 32: 1}, calls)
    pick = tuner.run(("k",), candidates, launch, device=CPU)
    assert pick.kwargs["BLOCK_M"] == 32 and tuner.tuned == 1
    calls.clear()
    tuner.run(("k",), candidates, launch, device=CPU)
    assert calls == [32]  # no timing: the real launch only


def test_a_candidate_whose_own_tiles_do_not_compile_is_skipped():
    """A candidate that is itself a tuned launch (the fused attention backward) and
    finds no tile that compiles loses to the others, as a tile that does not compile
    does; when none is left, the error says so."""
    tuner, inner = tuning.Tuner("outer"), tuning.Tuner("inner")

    def out_of_resources(config):
        from triton.runtime.errors import OutOfResources

        raise OutOfResources(1 << 20, 1 << 18, "shared memory")

    def launch(config):
        if config.kwargs["BLOCK_M"] == 16:  # its inner tuner has nothing that builds
            inner.run(("k",), candidates, out_of_resources, device=CPU)

    assert tuner.run(("k",), candidates, launch, device=CPU).kwargs["BLOCK_M"] == 32
    with pytest.raises(tuning.NoConfigCompiles, match="no candidate config compiles"):
        tuner.run(("k2",), lambda: CONFIGS[:1] * 2, launch, device=CPU)


def test_restores_what_the_kernel_adds_into_after_timing():
    tuner, acc = tuning.Tuner("t"), torch.zeros(3)

    def accumulate(config):
        acc.add_(1.0)

    tuner.run(("k",), candidates, accumulate, device=CPU, restore=[acc])
    assert torch.equal(acc, torch.ones(3))  # the timed runs were undone; one real launch


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_restores_c_only_when_accumulating(monkeypatch, accumulate):
    seen = []
    original = tuning.Tuner.run

    def spy(self, key, candidates, launch, **kwargs):
        seen.append(len(kwargs["restore"]))
        return original(self, key, candidates, launch, **kwargs)

    monkeypatch.setattr(tuning.Tuner, "run", spy)
    a, b = randn((5, 7), torch.float32, 0), randn((7, 3), torch.float32, 1)
    matmul(a, b, out=torch.zeros(5, 3), accumulate=accumulate)
    assert seen == [1 if accumulate else 0]


def test_growing_lengths_share_a_bucket():
    a = randn((64, 16), torch.float32, 0)
    b = randn((16, 8), torch.float32, 1)
    for m in (33, 40, 64):  # one bucket: 64
        matmul(a[:m], b)
    matmul(a[:20], b)  # bucket 32
    assert tuning.tuner("matmul").tuned == 2
    q = randn((1, 70, 2, 16), torch.float32, 2)
    for s in (65, 70):  # attention keys bucket Sq and Skv alike
        fp.flash_attn(q[:, :s], q[:, :s], q[:, :s])
    assert tuning.tuner("_attn_fwd_kernel").tuned == 1


def test_first_candidate_without_timing(monkeypatch):
    monkeypatch.setenv("FUSEDPAR_TUNING", "first")
    calls = []
    pick = tuning.Tuner("t").run(("k",), candidates, _sleepy({16: 5, 32: 1}, calls), device=CPU)
    assert pick.kwargs["BLOCK_M"] == 16 and calls == [16]


def test_picks_survive_in_the_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDPAR_TUNING_CACHE", str(tmp_path / "picks.json"))
    calls = []
    tuning.Tuner("t").run(("k", 1), candidates, _sleepy({16: 20, 32: 1}, calls), device=CPU)
    calls.clear()
    pick = tuning.Tuner("t").run(("k", 1), candidates, _sleepy({16: 20, 32: 1}, calls), device=CPU)
    assert pick.kwargs["BLOCK_M"] == 32 and calls == [32]  # read back, not timed again


def test_frozen_loops_refuse_to_tune():
    tuner = tuning.Tuner("t")
    with tuning.frozen("a test loop", None), pytest.raises(RuntimeError, match="a test loop"):
        tuner.run(("k",), candidates, lambda c: None, device=CPU)
    tuner.run(
        ("k",), candidates, lambda c: None, device=CPU, launch_as=tuning.Launch(tune_only=True)
    )
    with tuning.frozen("a test loop", None):
        tuner.run(("k",), candidates, lambda c: None, device=CPU)  # tuned: fine
    other = tuning.Agreement("group x", lambda t: t)
    with tuning.frozen("a test loop", None), pytest.raises(RuntimeError, match="group x"):
        tuner.run(("k",), candidates, lambda c: None, device=CPU, launch_as=tuning.Launch(other))


def _agree_on_a_tile():
    """Rank 0 alone would pick 16 (1 ms vs 40), rank 1 alone 32 (5 vs 80): the sums are
    81 against 45, so both pick 32."""
    rank = dist.get_rank()
    times = {16: 1, 32: 40} if rank == 0 else {16: 80, 32: 5}
    alone = tuning.Tuner("alone").run(("k",), candidates, _sleepy(times, []), device=CPU)
    agreement = fp.comm.tuning_agreement(dist.group.WORLD, torch.device("cpu"))
    together = tuning.Tuner("together").run(
        ("k",), candidates, _sleepy(times, []), device=CPU, launch_as=tuning.Launch(agreement)
    )
    return alone.kwargs["BLOCK_M"], together.kwargs["BLOCK_M"]


def test_ranks_of_a_group_agree_on_one_pick(world):
    assert world(2).run(_agree_on_a_tile) == [(16, 32), (32, 32)]


def _ring_without_tuning_step():
    from fusedpar.ops import ring_attention

    tuning.forget_picks()
    ring_attention._tuned_launches = lambda size: ()  # skip the tuning step
    q = randn((1, 8, 2, 16), torch.float32, dist.get_rank())
    fp.ring_attn(q, q, q, dist.group.WORLD, causal=True)


def test_ring_loops_launch_only_what_they_tuned_before(world):
    """The error must fail the call: it leaves a transfer posted, so the pool restarts
    (caught inside the ranks, the next test's collectives would meet it and hang)."""
    with pytest.raises(WorldError) as info:
        world(2).run(_ring_without_tuning_step)
    errors = info.value.exceptions
    assert sorted(errors) == [0, 1]
    for e in errors.values():
        assert isinstance(e, RuntimeError) and "inside the ring attention forward" in str(e)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_tuning_on_a_gpu_leaves_one_result(accumulate):
    """Compiled, every candidate runs many times while it is timed: the output must end
    as one call's (C + A @ B once when accumulating, restored in between)."""
    a = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(1000, 384, device="cuda", dtype=torch.float32)
    expected = (c.double() if accumulate else 0) + a.double() @ b.double()
    matmul(a, b, out=c, accumulate=accumulate)
    assert tuning.tuner("matmul").timings, "nothing was tuned"
    assert len(next(iter(tuning.tuner("matmul").timings.values()))) > 1
    torch.testing.assert_close(c.double(), expected, rtol=2e-2, atol=2e-2)


def test_a_forced_config_runs_without_timing_or_caching():
    tuner, calls = tuning.Tuner("t"), []
    launch = _sleepy({16: 1, 32: 1}, calls)
    with tuning.forced("t", CONFIGS[1]):
        assert tuner.run(("k",), candidates, launch, device=CPU) is CONFIGS[1]
    assert calls == [32] and not tuner.picks and tuner.tuned == 0


def _launchers():
    """(tuner name, a call of its launcher) for each way a settled pick is kept: a GEMM
    plan, a row kernel's fixed tile, a grouped GEMM plan, the weights' gradient."""
    from fusedpar.kernels.gated import gated
    from fusedpar.kernels.moe import grouped_matmul
    from fusedpar.kernels.moe_weight_grad import grouped_weight_grad

    a, b = randn((9, 12), torch.float32, 0), randn((12, 7), torch.float32, 1)
    counts = torch.tensor([4, 0, 5])
    w = randn((3, 7, 12), torch.float32, 2)
    dy, up = randn((9, 7), torch.float32, 3), randn((9, 12), torch.float32, 4)
    return {
        "matmul": lambda: matmul(a, b),
        "_gated_kernel": lambda: gated(a, up, "silu"),
        "grouped_matmul": lambda: grouped_matmul(a, w, counts),
        "grouped_weight_grad": lambda: grouped_weight_grad(dy, a, counts),
    }


@pytest.mark.parametrize(
    "name", ["matmul", "_gated_kernel", "grouped_matmul", "grouped_weight_grad"]
)
def test_a_settled_pick_skips_the_tuner_until_overridden(monkeypatch, name):
    """Once a key's pick is made, a planned launch reuses its grid and keywords and skips
    `Tuner.run`; a forced config, a frozen loop or forgotten picks send it back there."""
    runs = []
    original = tuning.Tuner.run

    def spy(self, *args, **kwargs):
        runs.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tuning.Tuner, "run", spy)
    call = _launchers()[name]
    first = call()
    assert runs == [name]
    again = call()
    assert runs == [name], "a settled pick went through the tuner again"
    assert torch.equal(first, again)
    (pick,) = tuning.tuner(name).picks.values()
    with tuning.forced(name, pick):
        call()
    with tuning.frozen("a test loop", None):
        call()
    tuning.forget_picks()
    assert torch.equal(call(), first)
    assert runs == [name] * 4
