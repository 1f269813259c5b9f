"""fusedpar.testing.World: results, failures, hangs, respawns, no orphans; a failed call
keeps the pool only when the ranks are still in step."""

import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from fusedpar.testing import World, WorldError, WorldTimeout, shared_world
from fusedpar.testing import world as world_module
from fusedpar.testing.strategies import randn, seeds

# --- functions the ranks run (module level: World pickles them by name) -------------


def whoami():
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def gather_and_sum(seed, shape):
    x = randn(shape, torch.float32, seed + dist.get_rank())
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    total = x.clone()
    dist.all_reduce(total)
    return torch.cat(gathered), total


def raise_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} rejects its input")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for the rank that raised
    return t.item()


def raise_everywhere():
    raise ValueError(f"bad input seen on rank {dist.get_rank()}")


def raise_the_same_everywhere():
    raise ValueError("the same bad input on every rank")


def raise_after_collective(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} dislikes the sum")
    return t.item()


def sleep_on(rank, seconds):
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def exit_on(rank):
    if dist.get_rank() == rank:
        os._exit(3)
    return dist.get_rank()


# --- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_run_returns_rank_results(world, world_size):
    results = world(world_size).run(whoami)
    assert [r[:2] for r in results] == [(rank, world_size) for rank in range(world_size)]
    assert len({pid for _, _, pid in results}) == world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_pool_is_reused(world, world_size):
    w = world(world_size)
    pids = [r[2] for r in w.run(whoami)]
    starts = w.starts
    assert [r[2] for r in w.run(whoami)] == pids
    assert w.starts == starts


@given(seed=seeds(), rows=st.integers(0, 5), cols=st.integers(1, 4))
def test_collectives_match_single_process(world, seed, rows, cols):
    world_size = 4
    results = world(world_size).run(gather_and_sum, seed, (rows, cols))
    parts = [randn((rows, cols), torch.float32, seed + r) for r in range(world_size)]
    for gathered, total in results:
        assert torch.equal(gathered, torch.cat(parts))
        torch.testing.assert_close(total, sum(parts[1:], parts[0].clone()), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def scratch_world():
    """A pool of its own, so the failures below do not restart the shared ones. The check
    after a failed call may take its time on a loaded machine: the tests below that keep
    the pool pass it in milliseconds, and those that restart fail it at once."""
    with pytest.MonkeyPatch.context() as patch, World(2, timeout=60) as w:
        patch.setattr(world_module, "CHECK_TIMEOUT_S", 30.0)
        yield w


def pids(world: World) -> list[int]:
    return [pid for _, _, pid in world.run(whoami)]


def test_a_raising_rank_fails_the_call_with_every_traceback(scratch_world, monkeypatch):
    monkeypatch.setattr(world_module, "ERROR_GRACE_S", 1.0)  # rank 0 waits for ever
    starts = scratch_world.starts
    with pytest.raises(WorldError) as info:
        scratch_world.run(raise_on, 1)
    err = info.value
    assert not isinstance(err, WorldTimeout)
    assert set(err.exceptions) == {1} and isinstance(err.exceptions[1], ValueError)
    assert "rank 1 rejects its input" in err.tracebacks[1]
    # rank 0 was left in all_reduce: its stack says where
    assert "raise_on" in err.tracebacks[0] and "all_reduce" in err.tracebacks[0]
    assert "--- rank 0 ---" in str(err) and "--- rank 1 ---" in str(err)
    assert scratch_world.run(whoami)[1][:2] == (1, 2)  # respawned, usable
    assert scratch_world.starts == starts + 1  # a rank stuck in a collective: out of step


def test_every_rank_raising_fails_fast_and_keeps_the_pool(scratch_world):
    before, starts = pids(scratch_world), scratch_world.starts
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        scratch_world.run(raise_everywhere)
    assert time.monotonic() - t0 < 5  # nobody waited out the error grace
    assert sorted(info.value.exceptions) == [0, 1]
    assert all(isinstance(e, ValueError) for e in info.value.exceptions.values())
    assert "bad input seen on rank 0" in str(info.value)
    assert "bad input seen on rank 1" in str(info.value)
    assert scratch_world.run(gather_and_sum, 0, (2, 3))[1][0].shape == (4, 3)
    assert pids(scratch_world) == before and scratch_world.starts == starts  # in step


def test_each_distinct_traceback_is_shown_once(scratch_world):
    with pytest.raises(WorldError) as info:
        scratch_world.run(raise_the_same_everywhere)
    message = str(info.value)
    assert message.count("Traceback (most recent call last)") == 1
    assert message.count("ValueError: the same bad input on every rank") == 1
    assert "--- ranks 0, 1 ---" in message and "--- rank 0 ---" not in message
    assert sorted(info.value.tracebacks) == sorted(info.value.exceptions) == [0, 1]
    assert info.value.tracebacks[0] == info.value.tracebacks[1]


def test_ranks_that_returned_beside_one_that_raised_keep_the_pool(scratch_world):
    before = pids(scratch_world)
    with pytest.raises(WorldError) as info:
        scratch_world.run(raise_after_collective, 0)
    assert set(info.value.exceptions) == {0} and set(info.value.tracebacks) == {0}
    assert scratch_world.run(raise_after_collective, -1) == [2.0, 2.0]
    assert pids(scratch_world) == before


def send_then_raise():
    if dist.get_rank() == 0:
        dist.isend(torch.full((4,), 7.0), dst=1)  # never received
    raise ValueError("both ranks give up")


def collective_on_one_rank_then_raise():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3), async_op=True)  # rank 1 never joins
    raise ValueError("both ranks give up")


def subgroup_on_one_rank_then_raise():
    if dist.get_rank() == 0:
        dist.new_group([0])  # rank 1 never makes it: the groups' names differ from now on
    raise ValueError("both ranks give up")


def ring_then_raise():
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((4,), 7.0), (rank + 1) % size),
            dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % size),
        ]
    )
    raise ValueError("both ranks give up before waiting for the exchange")


def send_recv_once():
    t = torch.full((4,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    total = torch.ones(1)
    dist.all_reduce(total)
    return t.tolist(), total.item()


@pytest.mark.parametrize(
    "fn, kept",
    [
        (send_then_raise, False),
        (collective_on_one_rank_then_raise, False),
        (subgroup_on_one_rank_then_raise, False),
        (ring_then_raise, True),  # every send has its receive: the check waits for them
    ],
)
def test_a_failure_never_leaks_into_the_next_call(scratch_world, fn, kept):
    before, starts = pids(scratch_world), scratch_world.starts
    with pytest.raises(WorldError):
        scratch_world.run(fn)
    assert scratch_world.run(send_recv_once, timeout=30) == [([0.0] * 4, 2.0)] * 2
    assert (pids(scratch_world) == before) == kept
    assert scratch_world.starts == starts + (not kept)


class Unpicklable:
    def __reduce__(self):
        return (_fail_to_rebuild, ())


def _fail_to_rebuild():
    raise RuntimeError("cannot rebuild this result")


def return_unpicklable():
    return Unpicklable() if dist.get_rank() == 0 else "fine"


def test_a_result_the_driver_cannot_read(scratch_world):
    with pytest.raises(WorldError) as info:
        scratch_world.run(return_unpicklable)
    assert "cannot rebuild" in info.value.tracebacks[0]
    assert scratch_world.run(whoami)[0][:2] == (0, 2)


def test_a_hanging_rank_times_out_with_its_stack(scratch_world):
    starts = scratch_world.starts
    t0 = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        scratch_world.run(sleep_on, 0, 600, timeout=2)
    assert time.monotonic() - t0 < 30
    assert "sleep_on" in info.value.tracebacks[0]
    assert "still running" in info.value.tracebacks[0]
    assert scratch_world.run(whoami)[0][:2] == (0, 2)
    assert scratch_world.starts == starts + 1


@pytest.mark.filterwarnings("ignore:World. the environment differs")  # (spawned: it does)
def test_a_failing_start_fails_fast(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface")  # init_process_group fails
    t0 = time.monotonic()
    with pytest.raises(WorldError, match="failed to start") as info:
        World(2, timeout=60).run(whoami)
    assert time.monotonic() - t0 < 30
    assert "no-such-interface" in str(info.value) and "__main__" not in str(info.value)


def _environment_seen(name):
    import torch._inductor.config as inductor

    return os.environ.get(name), inductor.max_autotune


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(),
    reason="every World is spawned here",
)
def test_a_world_started_in_another_environment_is_spawned_and_sees_it(monkeypatch):
    """The ranks' process server imported torch under the session's environment; a
    World started after a variable read at import changed gets spawned ranks (said once),
    which read it as a spawned process would."""
    shared_world(1).run(whoami)  # the server is running (the session's first World may be later)
    monkeypatch.setattr(world_module, "_said_spawned", False)
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    with (
        pytest.warns(UserWarning, match="TORCHINDUCTOR_MAX_AUTOTUNE.*spawned"),
        World(1, timeout=60) as w,
    ):
        assert w.run(_environment_seen, "TORCHINDUCTOR_MAX_AUTOTUNE") == [("1", True)]


def test_a_dying_rank_fails_the_call(scratch_world):
    with pytest.raises(WorldError) as info:
        scratch_world.run(exit_on, 1)
    assert "exit code 3" in info.value.tracebacks[1]
    assert scratch_world.run(whoami)[1][:2] == (1, 2)


def test_unpicklable_function_is_a_clear_type_error(scratch_world):
    with pytest.raises(TypeError, match="module level"):
        scratch_world.run(lambda: 1)


def test_close_leaves_no_processes():
    w = World(2)
    pids = [r[2] for r in w.run(whoami)]
    w.close()
    assert not w.alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        World(0)
    with pytest.raises(ValueError, match="backend"):
        World(2, backend="mpi")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_ranks_do_not_outlive_the_test_process(tmp_path):
    """Ranks end when the process that owns the World ends: by exiting, and by SIGKILL in
    the middle of a call: rank 0 never reads its pipe again, rank 1, done with the call,
    waits on its pipe idle (a SIGKILL between calls). The two owners run at once (each
    imports torch and fusedpar: seconds; a third, killed between calls, cost 8 s more)."""
    hows = ["exit", "killed-while-busy"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    owners = {}
    for how in hows:
        script = tmp_path / f"owner_{how}.py"
        script.write_text(
            "import os, signal, sys\n"
            "from fusedpar.testing import World\n"
            "from test_world import sleep_on, whoami\n"
            "if __name__ == '__main__':\n"
            "    w = World(2)\n"
            "    print(' '.join(str(r[2]) for r in w.run(whoami)), flush=True)\n"
            f"    if {how == 'killed-while-busy'}:\n"
            "        import threading\n"
            "        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
            "        w.run(sleep_on, 0, 600)\n"
        )
        owners[how] = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    pids = {}
    for how, owner in owners.items():
        try:  # (the pipes close when the ranks, which hold them too, have ended)
            out, err = owner.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            owner.kill()
            pytest.fail(f"{how}: the owner's ranks held its output open for 2 minutes")
        pids[how] = [int(p) for p in out.split()]
        assert len(pids[how]) == 2, (how, err)
    deadline = time.monotonic() + 10
    while any(_running(p) for ps in pids.values() for p in ps) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [how for how, ps in pids.items() if any(map(_running, ps))]
