"""`World`: a persistent pool of ranks for running parallel code from one test process.

    with World(4) as world:
        results = world.run(fn, *args)   # fn(*args) on every rank, results in rank order

Each rank is a process with the default process group initialized (gloo on CPU, NCCL on
GPUs), reused for every call; ranks are forked from a process server that imported
torch and fusedpar once (`_rank_context`). ``fn`` and its arguments are pickled, so
``fn`` must be defined at module level. If any rank raises, `WorldError` carries every
rank's traceback; past the timeout, `WorldTimeout` carries every running rank's stack.

One failing test never leaves the next one a group out of step: after a failed call
every rank answered, the ranks check that they are still in step (the same groups,
collectives and point-to-point pairs; a barrier on each group within
`CHECK_TIMEOUT_S`) and the pool is kept; otherwise (a rank hung or died, a timeout, an
interrupt, a failed check, or NCCL) it is killed and started afresh on the next call.
docs/testing.md.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings

from fusedpar.kernels.impl import requested
from fusedpar.testing.world_rank import rank_main

# After the first rank fails, how long the others get to finish before they are taken to
# be stuck (typically in a collective that the failed rank never joined).
ERROR_GRACE_S = 5.0
# After a failed call, how long the ranks get to show they are still in step (milliseconds
# when they are) before the pool is killed instead.
CHECK_TIMEOUT_S = 2.0
# How long a graceful shutdown may take before the ranks are killed.
CLOSE_TIMEOUT_S = 10.0


class WorldError(RuntimeError):
    """A `World.run` call failed on at least one rank.

    ``exceptions`` maps each failed rank to the exception it raised (a ``RuntimeError``
    stand-in when the original cannot be pickled); ``tracebacks`` maps every rank that
    failed, hung or died to a text: its traceback, its stack dump, or its exit code.
    """

    def __init__(self, message: str, exceptions: dict, tracebacks: dict):
        super().__init__(message)
        self.exceptions = exceptions
        self.tracebacks = tracebacks


class WorldTimeout(WorldError):
    """A `World.run` call ran past its timeout; ``tracebacks`` holds each rank's stack."""


class World:
    """A pool of `world_size` ranks, started on the first call, reused until `close`.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (rank r uses GPU r % device count).
        timeout: seconds a `run` call may take before it fails with `WorldTimeout`.
        threads_per_rank: ``torch.set_num_threads`` in each rank; by default the cores are
            shared out, so W ranks do not oversubscribe the machine.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 300.0,
        threads_per_rank: int | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl":
            import torch

            if torch.cuda.device_count() < world_size:
                raise ValueError(
                    f"World({world_size}, backend='nccl') needs a GPU per rank, "
                    f"this machine has {torch.cuda.device_count()}"
                )
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._procs: list = []
        self._conns: list = []
        self._alive: list = []  # the write ends of the ranks' liveness pipes
        self._tmpdir: str | None = None
        self.starts = 0  # how many times the pool was (re)started; tests read it

    # --- life cycle -------------------------------------------------------------------

    def __enter__(self) -> World:
        self._ensure_started()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _ensure_started(self) -> None:
        if self._procs:
            if self.alive:
                return
            self._kill()
        ctx = _rank_context()
        self._tmpdir = tempfile.mkdtemp(prefix="fusedpar-world-")
        init_file = os.path.join(self._tmpdir, "init")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            # the rank's liveness pipe: only this process holds the write end, so the rank
            # reads EOF once this process is gone, however it ended (`_watch_owner`)
            alive_r, alive_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=rank_main,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    init_file,
                    child_conn,
                    self._dump_path(rank),
                    self.threads_per_rank,
                    alive_r,
                ),
                name=f"fusedpar-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            alive_r.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._alive.append(alive_w)
        self.starts += 1
        _live_worlds.add(self)
        try:
            deadline = time.monotonic() + max(self.timeout, 120)
            replies = self._collect(range(self.world_size), deadline, ERROR_GRACE_S)
        except BaseException:
            self._kill()
            raise
        failed = {r: text for r, (kind, text) in replies.items() if kind != "ready"}
        failed.update({r: "no reply" for r in range(self.world_size) if r not in replies})
        if failed:
            self._kill()
            details = "\n".join(_sections(failed))
            hint = ""
            if any(kind == "died" for kind, _ in replies.values()):
                hint = (
                    " (a script that makes a World needs an `if __name__ == '__main__':` "
                    "guard: the ranks' process server imports it)"
                )
            raise WorldError(
                f"World({self.world_size}) failed to start{hint}\n{details}", {}, failed
            )

    def close(self) -> None:
        """Shut the ranks down (gracefully, then by force). The World can start again."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead rank's pipe is closed
                conn.send_bytes(pickle.dumps(("close", None)))
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in (*self._conns, *self._alive):
            conn.close()
        self._procs, self._conns, self._alive = [], [], []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        _live_worlds.discard(self)

    # --- calls ------------------------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        try:
            payload = _call_message(fn, args, kwargs)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"World.run pickles fn and its arguments for the ranks: {e}. Define fn at "
                "module level and pass plain data (numbers, strings, tensors, dicts)."
            ) from e
        self._ensure_started()
        timeout = self.timeout if timeout is None else timeout
        try:
            results, exceptions, texts, stuck, answered = self._call(payload, timeout)
            # Even when every rank answered, a failed call may leave the group out of step
            # (a send no one received, a collective one rank skipped): unless the ranks show
            # that they are in step, start afresh.
            if texts and not (answered and self._in_step()):
                self._kill()
        except BaseException:  # interrupted: unread replies would answer the next call
            self._kill()
            raise
        if not texts:
            return results
        what = "timed out" if set(texts) == set(stuck) else "failed"
        lines = [f"World({self.world_size}).run({getattr(fn, '__qualname__', fn)}) {what}:"]
        lines += _sections(texts)
        error = WorldTimeout if what == "timed out" else WorldError
        raise error("\n".join(lines), exceptions, texts)

    def _call(self, payload: bytes, timeout: float):
        for conn in self._conns:
            conn.send_bytes(payload)
        start = time.monotonic()
        replies = self._collect(range(self.world_size), start + timeout, ERROR_GRACE_S)
        results = [None] * self.world_size
        exceptions, texts = {}, {}
        for rank, (kind, value) in replies.items():
            if kind == "ok":
                results[rank] = value
            elif kind == "error":
                exceptions[rank], texts[rank] = _revive(value), value["traceback"]
            else:  # died, or a reply this process cannot unpickle
                texts[rank] = value
        stuck = sorted(set(range(self.world_size)) - set(replies))
        elapsed = time.monotonic() - start
        for rank, stack in self._dump_stacks(stuck).items():
            texts[rank] = f"still running after {elapsed:.1f} s; its stack:\n{stack}"
        # every rank read its whole reply off its pipe and is back waiting for the next call
        answered = all(kind in ("ok", "error", "unreadable") for kind, _ in replies.values())
        return results, exceptions, texts, stuck, answered and not stuck

    def _in_step(self) -> bool:
        """After a failed call that every rank answered: are the ranks still in step?

        Each rank reports what the call did to its process groups (its ledger's `state`,
        `fusedpar.testing.world_rank`); the reports must agree (`_agree`). Then each rank
        waits for its point-to-point works of the call and passes a barrier on each of its
        groups (the ledger's `settle`), in time.
        """
        if self.backend != "gloo":  # NCCL: a collective left on a GPU is not proven gone
            return False
        states = self._ask_all("state")
        return states is not None and _agree(states) and self._ask_all("sync") is not None

    def _ask_all(self, request: str) -> dict | None:
        """Every (idle) rank's answer to `request`, or None if one failed or was late."""
        try:
            for conn in self._conns:
                conn.send_bytes(pickle.dumps((request, None)))
        except OSError:  # a rank's pipe is closed
            return None
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        replies = self._collect(range(self.world_size), deadline, grace=0.0)
        if len(replies) < self.world_size or any(k != "ok" for k, _ in replies.values()):
            return None
        return {rank: value for rank, (_, value) in replies.items()}

    def _collect(self, ranks, deadline: float, grace: float | None = None) -> dict:
        """Read one reply from each of `ranks` until `deadline` (or `grace` s after an error)."""
        waiting = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        replies: dict[int, tuple] = {}
        while waiting:
            ready = mp.connection.wait(
                list(waiting) + [s for s, r in sentinels.items() if r not in replies],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                break
            for obj in ready:
                if obj in waiting and obj.poll():
                    rank = waiting.pop(obj)
                    try:
                        replies[rank] = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        replies[rank] = ("died", self._death_note(rank))
                    except Exception:  # the rank's result cannot be rebuilt here
                        replies[rank] = ("unreadable", traceback.format_exc())
                elif obj in sentinels and sentinels[obj] not in replies:
                    rank = sentinels[obj]
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():
                        waiting.pop(conn)
                        replies[rank] = ("died", self._death_note(rank))
            if grace is not None and any(k not in ("ok", "ready") for k, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + grace)
                grace = None
        return replies

    def _death_note(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1.0)
        return f"rank {rank} exited (exit code {proc.exitcode}) without replying"

    def _dump_stacks(self, ranks) -> dict[int, str]:
        if not ranks:
            return {}
        offsets = {}
        for rank in ranks:
            path = self._dump_path(rank)
            offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes from the signal handler, promptly
        dumps = {}
        for rank in ranks:
            try:
                with open(self._dump_path(rank)) as f:
                    f.seek(offsets[rank])
                    dumps[rank] = f.read().strip() or "(no stack dump was written)"
            except OSError:
                dumps[rank] = "(no stack dump was written)"
        return dumps

    def _dump_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"stack{rank}.txt")


def exception_of(fn, *args, **kwargs) -> Exception | None:
    """``fn(*args, **kwargs)`` on a rank; the exception it raised (None if it returned).

    For testing errors that every rank must raise before any collective:
    ``world.run(exception_of, fn, *args)`` returns them all, in rank order, and the call
    does not fail (a failed call in which every rank raised keeps the pool too, after a
    check of a few milliseconds that the ranks are in step). A rank that entered a
    collective the others skipped still hangs the call into `WorldTimeout`, and the pool
    restarts.
    """
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - returned to the test, which checks it
        return e
    return None


_server_environment: dict | None = None  # this process's, when it started the fork server
_said_spawned = False
# set per test by pytest, read by no import: a change of it alone keeps the fork server
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def _rank_context():
    """Where ranks come from: forked from a process server (multiprocessing's
    "forkserver") that imported torch and fusedpar once, so a start or a restart after a
    failure costs a fork and ``init_process_group`` (about 0.5 s for 2 ranks on the 2-core
    machine) where a spawned rank imported them again (5-6 s). The server is this
    process's, started with the first World, and its imports read the environment of
    that moment (TRITON_INTERPRET, TORCH_LOGS, TORCHINDUCTOR_*, OMP_*...): a World started
    while the environment differs from it is spawned instead, as is every World where the
    platform has no fork server (said once)."""
    global _server_environment, _said_spawned
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    environment = {k: v for k, v in os.environ.items() if k not in _VOLATILE}
    if _server_environment is None:
        _server_environment = environment
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["fusedpar.testing.world_rank"])
        return ctx
    if environment == _server_environment:
        return mp.get_context("forkserver")
    if not _said_spawned:
        _said_spawned = True
        changed = sorted(
            k
            for k in {*environment, *_server_environment}
            if environment.get(k) != _server_environment.get(k)
        )
        warnings.warn(
            f"World: the environment differs from the one its process server "
            f"started with ({', '.join(changed[:5])}): such Worlds' ranks are "
            f"spawned, 5-6 s a start instead of 0.5 s",
            stacklevel=3,
        )
    return mp.get_context("spawn")


# --- pool sharing ----------------------------------------------------------------------

_live_worlds: set[World] = set()
_shared: dict[tuple, World] = {}


def shared_world(world_size: int, **kwargs) -> World:
    """A process-wide `World` per (world_size, options), made on first use.

    Test suites call this from many tests and hypothesis examples and get one pool per
    world size for the whole session. Every World still running is closed at exit.
    """
    key = (world_size, tuple(sorted(kwargs.items())))
    if key not in _shared:
        _shared[key] = World(world_size, **kwargs)
    return _shared[key]


@atexit.register
def _close_all() -> None:
    for world in list(_live_worlds):
        world.close()


def _sections(texts: dict[int, str]) -> list[str]:
    """Each distinct text once, headed by the ranks it came from ("--- ranks 0, 2 ---")."""
    ranks_of: dict[str, list[int]] = {}
    for rank in sorted(texts):
        ranks_of.setdefault(texts[rank], []).append(rank)
    return [
        f"--- rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ---\n{text}"
        for text, ranks in ranks_of.items()
    ]


def _agree(states: dict[int, dict | None]) -> bool:
    """Whether the ranks' ledger `state` reports show them in step: the same count of
    groups made; each group reported by exactly its members, with the same number of
    collectives issued in the call; as many sends as receives on each channel."""
    if any(state is None for state in states.values()):
        return False
    if len({state["made"] for state in states.values()}) != 1:
        return False
    views: dict[str, set] = {}  # group name: the (members, collectives) its members report
    members: dict[str, set] = {}  # group name: the ranks that report it
    for rank, state in states.items():
        for name, view in state["groups"].items():
            views.setdefault(name, set()).add(view)
            members.setdefault(name, set()).add(rank)
    if not all(
        len(seen) == 1 and set(next(iter(seen))[0]) == members[name] for name, seen in views.items()
    ):
        return False
    unmatched = collections.Counter()  # channel: sends issued less receives issued
    for state in states.values():
        for (kind, *channel), n in state["p2p"].items():
            unmatched[tuple(channel)] += n if kind == "send" else -n
    return not any(unmatched.values())


def _call_message(fn, args, kwargs) -> bytes:
    # The call is pickled on its own, so that a rank can take the driver's sys.path (where
    # fn's module may have been added since the rank started) before unpickling fn. The
    # implementation asked for here travels with it: `with fp.implementation("triton"):
    # world.run(fn)` runs fn's ops on Triton's kernels on every rank.
    call = pickle.dumps((fn, args, kwargs))
    return pickle.dumps(("call", (list(sys.path), requested(), call)))


def _revive(desc: dict) -> BaseException:
    if desc["pickled"] is not None:
        try:
            return pickle.loads(desc["pickled"])
        except Exception:
            pass
    return RuntimeError(f"{desc['type']}: {desc['message']}")
