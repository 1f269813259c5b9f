"""A rank SIGKILLed at any point of a checkpoint save: loading then refuses, or gives the
old checkpoint or the new one bit for bit, never a mix.

One subprocess (this file run as a script) imports torch once and forks a world of two
gloo ranks per scenario, all at once: each rank saves an old checkpoint, then a new one
during which one rank kills itself (``os.kill(os.getpid(), SIGKILL)``) at the scenario's
point, and its partner is SIGKILLed as soon as it is dead (as torchrun tears a job
down). The test process then loads what is on disk, in one process, and saves again.
Each rank holds half of two tensors (DTensor Shard(0)) and rank 0 the replicated one,
so a mix of two saves would show in every tensor.
"""

import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch

OLD, NEW = 1, 2  # the seeds of the two checkpoints, and their "step" in extra

# name: (where the victim dies, the victim, how the new save goes, async_save, outcome)
# how: "fresh" saves step-2 beside step-1; "over" overwrites step-1; "refused" saves to
# step-1 without overwrite=. Outcome of loading the new save's target: the old state, the
# new, or refused (FileNotFoundError: an interrupted save).
SCENARIOS = {
    "fresh-mid-write": ("mid-write", 1, "fresh", False, "refused"),
    "fresh-written": ("written", 1, "fresh", False, "refused"),
    "fresh-recorded": ("recorded", 0, "fresh", False, "refused"),
    "over-mid-write": ("mid-write", 0, "over", False, "old"),
    "over-written": ("written", 0, "over", False, "old"),
    "over-recorded": ("recorded", 0, "over", False, "old"),
    "over-aside": ("aside", 0, "over", False, "old"),
    "over-renamed": ("renamed", 0, "over", False, "new"),
    "over-no-kill": (None, None, "over", False, "new"),
    "async-over-mid-write": ("mid-write", 1, "over", True, "old"),
    "async-fresh-recorded": ("recorded", 0, "fresh", True, "refused"),
    "async-over-no-kill": (None, None, "over", True, "new"),
    "exists": (None, None, "refused", False, "old"),
}


def _full(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 16, generator=g),
        "v": torch.randn(32, 8, generator=g),
        "b": torch.randn(16, generator=g),
    }


class Tiny(torch.nn.Module):
    def __init__(self, tensors: dict):
        super().__init__()
        for name, tensor in tensors.items():
            setattr(self, name, torch.nn.Parameter(tensor))


# --- the ranks (forked by the script) ---------------------------------------------------


def _die(root: Path, point: str) -> None:
    (root / f"killed-at-{point}").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(root: Path, point: str) -> None:
    """Kill this rank at `point`: after the first tensor of its shard file is written
    ("mid-write"), or where fusedpar.checkpoint's hook says it stands."""
    if point == "mid-write":
        from torch.distributed.checkpoint import filesystem

        write_item = filesystem._write_item

        def write_one_then_die(transforms, stream, *args, **kwargs):
            result = write_item(transforms, stream, *args, **kwargs)
            stream.flush()
            _die(root, point)
            return result

        filesystem._write_item = write_one_then_die
    else:
        from fusedpar import checkpoint_files

        checkpoint_files.at = lambda at: _die(root, point) if at == point else None


def _rank(rank: int, root: Path, name: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fusedpar as fp

    point, victim, how, async_save, _ = SCENARIOS[name]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))

    def model(seed):
        full = _full(seed)
        local = {
            n: DTensor.from_local(t.chunk(2)[rank], mesh, [Shard(0)])  # rank 1's: a view
            for n, t in full.items()
            if n != "b"
        }
        local["b"] = DTensor.from_local(full["b"], mesh, [Replicate()])
        return Tiny(local)

    fp.checkpoint.save(root / "step-1", model(OLD), extra={"step": OLD})
    new = model(NEW)
    if rank == victim:
        _arm(root, point)
    target = root / ("step-2" if how == "fresh" else "step-1")
    try:
        pending = fp.checkpoint.save(
            target, new, extra={"step": NEW}, overwrite=how == "over", async_save=async_save
        )
        if pending is not None:
            with torch.no_grad():
                new.w.to_local().add_(1.0)  # training goes on: the checkpoint holds NEW
            pending.wait()
    except FileExistsError:
        (root / f"refused-{rank}").touch()
    dist.destroy_process_group()


def main(root: Path) -> None:
    """Fork every scenario's two ranks at once; SIGKILL a scenario's survivor as soon as
    its victim is dead; write each rank's end (a signal name or exit code) to
    root/report.json."""
    import torch.distributed.checkpoint  # noqa: F401 - imported once, before the forks
    import torch.distributed.tensor  # noqa: F401

    import fusedpar  # noqa: F401

    ranks = {}
    for name in SCENARIOS:
        (root / name).mkdir()
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _rank(rank, root / name, name)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                os._exit(code)
            ranks[pid] = (name, rank)
    ends, deadline = {}, time.monotonic() + 120
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:  # a hang: end them all, the test says where
                for pid in ranks:
                    os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.01)
            continue
        name, rank = ranks.pop(pid)
        if os.WIFSIGNALED(status):
            ends[f"{name}/{rank}"] = signal.Signals(os.WTERMSIG(status)).name
            for other, (other_name, _) in ranks.items():
                if other_name == name:
                    os.kill(other, signal.SIGKILL)
        else:
            ends[f"{name}/{rank}"] = os.WEXITSTATUS(status)
    (root / "report.json").write_text(json.dumps(ends))


# --- the test -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    import subprocess

    root = tmp_path_factory.mktemp("killed")
    proc = subprocess.run(
        [sys.executable, __file__, str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, json.loads((root / "report.json").read_text()), proc.stderr


def _outcome(target: Path):
    """("old" | "new", extra) of the checkpoint loaded from `target` in this process,
    asserting it is one of the two whole; or ("refused", the error)."""
    import fusedpar as fp

    model = Tiny({n: torch.zeros_like(t) for n, t in _full(OLD).items()})
    try:
        extra = fp.checkpoint.load(target, model)
    except (FileNotFoundError, ValueError) as e:
        assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())
        return "refused", e
    state = {n: p.detach() for n, p in model.named_parameters()}
    for which, seed in (("old", OLD), ("new", NEW)):
        if torch.equal(state["w"], _full(seed)["w"]):
            assert all(torch.equal(state[n], t) for n, t in _full(seed).items()), "a mix"
            assert extra == {"step": seed}, extra
            return which, extra
    raise AssertionError(f"neither checkpoint: {state['w'][:2]}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_rank_killed_in_a_save_leaves_the_old_checkpoint_or_the_new_one(killed, name):
    import fusedpar as fp

    root, ends, log = killed
    root = root / name
    point, victim, how, _, expected = SCENARIOS[name]
    if point is None:
        assert ends[f"{name}/0"] == ends[f"{name}/1"] == 0, log
    else:  # the victim died where it was told to (the partner was killed after it)
        assert ends[f"{name}/{victim}"] == "SIGKILL" and (root / f"killed-at-{point}").exists(), log
    if how == "refused":
        assert (root / "refused-0").exists() and (root / "refused-1").exists()
    target = root / ("step-2" if how == "fresh" else "step-1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome, detail = _outcome(target)
    assert outcome == expected, detail
    aside = [w for w in caught if "interrupted between its two renames" in str(w.message)]
    assert len(aside) == (point == "aside")  # the old one, set aside, said so
    if outcome == "refused":
        assert isinstance(detail, FileNotFoundError) and "interrupted" in str(detail), detail
    # latest: the newest complete one (step-1 when step-2's save was killed)
    newest = fp.checkpoint.latest(root)
    assert newest is not None and Path(newest).parent == root
    assert _outcome(Path(newest))[0] == ("new" if expected == "new" else "old")
    # the next save to the target succeeds and leaves nothing of the killed one beside it
    fp.checkpoint.save(target, Tiny(_full(NEW)), extra={"step": NEW}, overwrite=True)
    assert _outcome(target)[0] == "new"
    assert sorted(p.name for p in root.glob(".step-*")) == []


if __name__ == "__main__":
    main(Path(sys.argv[1]))
