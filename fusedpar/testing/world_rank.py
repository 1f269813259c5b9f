"""What runs in each rank of a `fusedpar.testing.World`: the call loop, the ledger of
what a call did to the process groups (the driver's check after a failed call, see
`World`), and the watch on the test process."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import threading
import traceback
from datetime import timedelta

from fusedpar.kernels.impl import implementation


def _describe(exc: BaseException) -> dict:
    text = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return {"type": type(exc).__name__, "message": str(exc), "traceback": text, "pickled": blob}


class _Ledger:
    """In a rank: what the current call did to the process groups, for the check after a
    failed call (`World._in_step`).

    Collectives are counted by torch (each group's sequence number counts every operation
    issued on it). Point-to-point operations leave nothing a barrier could see: an
    unmatched send waits, in its pair of ranks, for a receive with its tag in some later
    call, and a receive whose work is dropped before it completes leaves its pair out of
    step. So ProcessGroup's send and receives (which dist.send, isend, recv, irecv and
    batch_isend_irecv call) are wrapped: each operation is counted by channel (group,
    sending rank, receiving rank, tag, in the group's ranks), and its work is kept until
    it has been waited for.
    """

    def __init__(self):
        self.counting = self._wrap_p2p()
        self.begin()

    def begin(self) -> None:
        # ("send" | "recv", *channel): operations in this call; None: one was not placed
        self.p2p: collections.Counter | None = collections.Counter() if self.counting else None
        self.unwaited: list = []  # this call's point-to-point works not yet waited for
        self.prune_at = 64
        self.ops_before = _operations()  # group name: operations issued before the call

    def _wrap_p2p(self) -> bool:
        import torch.distributed as dist

        def counted(method, kind):
            def call(pg, *args, **kwargs):
                work = method(pg, *args, **kwargs)
                self._note(pg, kind, args, kwargs, work)
                return work

            call.__name__, call.__doc__ = method.__name__, method.__doc__
            return call

        originals = {}
        try:
            for kind in ("send", "recv", "recv_anysource"):
                originals[kind] = getattr(dist.ProcessGroup, kind)
                setattr(dist.ProcessGroup, kind, counted(originals[kind], kind))
        except (AttributeError, TypeError):  # this torch's class cannot be wrapped: no count
            for kind, method in originals.items():
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(dist.ProcessGroup, kind, method)
            return False
        return True

    def _note(self, pg, kind: str, args: tuple, kwargs: dict, work) -> None:
        # ProcessGroup.send(tensors, dstRank, tag), .recv(tensors, srcRank, tag)
        import torch.distributed as dist

        self.unwaited.append(work)
        if len(self.unwaited) >= self.prune_at:  # the waited ones need no keeping
            self.unwaited = [w for w in self.unwaited if not w.is_completed()]
            self.prune_at = max(64, 2 * len(self.unwaited))
        if self.p2p is None:
            return
        try:
            if kind == "recv_anysource":  # from whom is known only once it arrives
                raise LookupError(kind)
            peer = args[1] if len(args) > 1 else kwargs["dstRank" if kind == "send" else "srcRank"]
            tag = int(args[2] if len(args) > 2 else kwargs.get("tag", 0))
            name, me, peer = dist.distributed_c10d._world.pg_names[pg], pg.rank(), int(peer)
            channel = (name, me, peer, tag) if kind == "send" else (name, peer, me, tag)
            self.p2p[(kind, *channel)] += 1
        except Exception:  # noqa: BLE001 - an operation not placed: the call is not vouched for
            self.p2p = None

    def state(self) -> dict | None:
        """This rank's process groups after a failed call, for `_agree`: each group's
        members and the collectives issued on it in the call, how many groups were made,
        and the point-to-point operations of the call by channel; None where the rank
        cannot vouch for them (an operation not placed, no default group, a torch that
        does not say)."""
        import torch.distributed as dist

        after, p2p = _operations(), self.p2p
        if p2p is None or self.ops_before is None or after is None or not dist.is_initialized():
            return None
        try:
            world = dist.distributed_c10d._world
            groups = {}
            for pg, name in world.pg_names.items():
                own_p2p = sum(n for (_, group, *_), n in p2p.items() if group == name)
                collectives = after[name] - self.ops_before.get(name, 0) - own_p2p
                groups[name] = (tuple(dist.get_process_group_ranks(pg)), collectives)
            return {"groups": groups, "made": world.group_count, "p2p": dict(p2p)}
        except Exception:  # noqa: BLE001 - another torch's internals: restart instead
            return None

    def settle(self) -> None:
        """Once the ranks' states agree: wait for the call's point-to-point works (each has
        its match), then pass a barrier on each group, in the same order on every rank.
        gloo's barrier waits for the collectives in flight before it: one that another rank
        never matched keeps it from completing, and the driver's check times out."""
        import torch.distributed as dist

        for work in self.unwaited:
            if not work.is_completed():  # (a gloo work waited twice waits for a second op)
                work.wait()
        self.unwaited = []
        names = dist.distributed_c10d._world.pg_names
        for pg in sorted(names, key=names.get):
            dist.barrier(group=pg)


_ledger: _Ledger | None = None  # in a rank, made once torch.distributed is imported


def _operations() -> dict | None:
    """Operations (collectives and point-to-point) issued so far on each of this rank's
    process groups, by group name; None if this torch does not say."""
    import torch.distributed as dist

    try:
        world = dist.distributed_c10d._world
        return {name: pg._get_sequence_number_for_group() for pg, name in world.pg_names.items()}
    except Exception:  # noqa: BLE001 - another torch's internals: restart instead
        return None


def _watch_owner(alive) -> None:
    # A rank stuck in a collective never reads its pipe again; this thread still sees the
    # World's process go away (its liveness pipe's only writer: EOF, however it ended) and
    # ends the rank, so no process outlives the session.
    with contextlib.suppress(EOFError, OSError):
        alive.recv_bytes()
    os._exit(1)


def rank_main(rank, world_size, backend, init_file, conn, dump_path, threads, alive):
    global _ledger
    dump_file = open(dump_path, "w")  # noqa: SIM115 (stays open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    threading.Thread(target=_watch_owner, args=(alive,), daemon=True).start()
    if "numpy" in sys.modules:  # forked: numpy's global generator is the server's state
        sys.modules["numpy"].random.seed()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        elif sys.platform == "linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this host
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(hours=1),  # the driver's per-call timeout is what counts
        )
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("init-error", _describe(e)["traceback"])))
        return
    _ledger = _Ledger() if backend == "gloo" else None  # NCCL restarts after any failure
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            kind, payload = pickle.loads(message)
            if kind == "close":
                break
            if kind == "state":  # after a failed call: the driver checks the ranks agree
                reply = ("ok", _ledger.state())
            elif kind == "sync":  # ... and then that nothing is left in flight
                _ledger.settle()
                reply = ("ok", None)
            else:
                if _ledger is not None:
                    _ledger.begin()
                path, request, call = payload
                sys.path[:0] = [p for p in path if p not in sys.path]  # before fn is imported
                fn, args, kwargs = pickle.loads(call)
                with implementation(request):
                    reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:
            reply = ("error", _describe(e))
        try:
            blob = pickle.dumps(reply)
        except Exception as e:
            blob = pickle.dumps(("error", _describe(TypeError(f"result cannot be pickled: {e}"))))
        conn.send_bytes(blob)
    dist.destroy_process_group()
