"""The directory a checkpoint save becomes, atomically (`fusedpar.checkpoint`'s
machinery; no DCP in here).

    PARENT/NAME             the checkpoint, complete: its files and RECORD
    PARENT/.NAME.tmp-ID     a save being written (ID: the save's, agreed by the ranks)
    PARENT/.NAME.old-ID     the checkpoint an overwrite replaces, between its two renames

A save: `enter` (every rank called it, within ``FUSEDPAR_CHECKPOINT_TIMEOUT_S``: the
default group's store, no collective), `begin` (every rank agrees on the ID, or on
refusing: one collective), DCP writes into the temporary directory, `commit` (every
rank's files written: one collective; rank 0 writes RECORD, renames; every rank learns
the outcome: one more). A load starts with `enter` too. Only rank 0 touches names; every
rank reads the same directory (a shared file system).
"""

import builtins
import io
import json
import math
import os
import re
import secrets
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

RECORD = "complete.json"  # the completion record, written last, inside the checkpoint
FORMAT = 1  # the record's format
DCP_METADATA = ".metadata"  # DCP's own index, written by its coordinator last
STEP = re.compile(r"step-(\d+)")


def at(point: str) -> None:
    """Where a save stands; does nothing (tests/checkpoint/test_checkpoint_kill.py kills a rank
    here). "written": this rank's files are written, on its way to the barrier;
    "recorded": rank 0 wrote the record, nothing is renamed; "aside": rank 0, overwriting,
    renamed the old checkpoint aside, the new one is not in place; "renamed": the new one
    is in place, the old one not yet removed."""


# --- communication: the world (all ranks), skipped on a world of one --------------------


def world(group=None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size(group)


def gather(obj, group) -> list:
    """Every rank's `obj`, in rank order (one all_gather_object; none on one rank)."""
    if world(group)[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, group):
    """Rank 0's `obj` on every rank."""
    if world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def first_failure(reports: list, what: str) -> None:
    """Raise, on every rank, the first rank's (type name, message) in `reports`."""
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return
    rank, (kind, message) = failed[0]
    error = getattr(builtins, kind, None)
    if not (isinstance(error, type) and issubclass(error, Exception)):
        error = RuntimeError
    where = f" (rank {rank})" if len(reports) > 1 and rank != 0 else ""
    raise error(f"{what}{where}: {message}" if what else f"{message}{where}")


def report(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


# --- every rank enters: a barrier with a timeout, on the default group's store ----------

TIMEOUT_ENV = "FUSEDPAR_CHECKPOINT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
_SLOT = "fusedpar/checkpoint/{n}/"  # the n-th save or load every rank made: its rounds
_ROUND = "fusedpar/checkpoint/{n}.{gen}/"  # a try at it: one more after each give-up
_SHUT = 2  # what a rank that gives up adds to each entry: 1 came, 2 shut out, 3 came first
_MET = b"met"
_entered = None  # (the default group, how many save/load calls this rank passed, the round
#                   it passed the last one in)


def timeout_s() -> float:
    """``FUSEDPAR_CHECKPOINT_TIMEOUT_S`` (read at each call; default 120): how long a save
    or load waits for every rank to call it. ValueError unless a number of seconds > 0."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{TIMEOUT_ENV} must be a number of seconds > 0 (default "
            f"{DEFAULT_TIMEOUT_S:g}), got {text!r}"
        )
    return value


def enter(call: str, undone: str) -> None:
    """The first step of a collective save or load (`call`: its name in messages,
    "fp.checkpoint.save", "save_pretrained"; `undone`: what did not happen, "written"):
    wait until every rank has called it, at most ``FUSEDPAR_CHECKPOINT_TIMEOUT_S``, then
    TimeoutError naming the ranks that did not, before anything is written or read.

    On the default group's store, not a collective: a rank that calls save alone (the
    habit of one GPU: ``if rank == 0: save(...)``) would otherwise wait forever in the
    first collective, and the others, which never call it, could not be told. gloo's
    `monitored_barrier` names the missing ranks too, but NCCL has none, and a gloo side
    group for it is itself made by a collective (one rank alone would hang making it).
    `meet` decides, the same way on every rank that called it: all passed, or all raise
    TimeoutError (a rank that comes just after another gave up too). A rank that raises
    keeps its count of calls N, so the group stays in step for the next call made by
    every rank. Ranks that entered different calls (one save, one load) raise ValueError
    on every rank. The keys of call N - 1 and of call N's failed rounds are deleted once
    N is passed (`tidy`): by then every rank is past them."""
    global _entered
    timeout = timeout_s()  # validated on every rank, even alone
    rank, size = world()
    if size == 1:
        return
    group = dist.group.WORLD
    n, last = _entered[1:] if _entered is not None and _entered[0] is group else (0, 0)
    store = dist.distributed_c10d._get_default_store()
    gen = meet(store, n, rank, size, call, undone, timeout)
    _entered = (group, n + 1, gen)
    tidy(store, n, gen, rank, last)
    keys = [_ROUND.format(n=n, gen=gen) + f"call/{r}" for r in range(size)]
    calls = [value.decode() for value in store.multi_get(keys)]
    if len(set(calls)) > 1:
        other = next(r for r, c in enumerate(calls) if c != calls[0])
        raise ValueError(
            f"the ranks made different checkpoint calls at once (rank 0: {calls[0]}, "
            f"rank {other}: {calls[other]}): every rank must make the same one"
        )


def meet(store, n: int, rank: int, size: int, call: str, undone: str, timeout: float) -> int:
    """Wait on `store` (a torch.distributed Store) until all `size` ranks have entered
    their `n`-th save or load, at most `timeout` seconds from this rank's entry, and
    return the round they met in; else TimeoutError, on every rank that entered, naming
    the ranks that had not (`call`, `undone`: the message's words).

    One verdict for all, decided by the store's atomic `add`, so no rank can pass alone
    into the first collective (where it would hang). Round R of call n (R: the key
    SLOT/gen, which a failed round increments): each rank records its `call`, adds 1 to
    its entry ROUND/in/RANK, then 1 to ROUND/count; the rank whose count reaches `size`
    declares the round met (ROUND/verdict). A rank whose wait for the verdict runs out
    adds 1 to ROUND/giveup, and the first to do so (one rank) adds _SHUT to every rank's
    entry: each result says whether that rank had come (its 1 was there). If all had,
    the round is met (the count reaches `size`); else it fails, naming the ranks that
    had not, and a rank that comes after finds its entry shut (its 1 gives 3) and fails
    too, whatever the count, which can then never reach `size`. The other ranks wait for
    the verdict the deciding rank writes, at most `timeout` more; past that (only the
    deciding rank stalled between two of its store calls can cause it), TimeoutError
    saying a rank gave up, and the ranks may part (docs/checkpointing.md)."""
    slot = _SLOT.format(n=n)
    gen = store.add(slot + "gen", 0)
    key = _ROUND.format(n=n, gen=gen)
    store.set(key + f"call/{rank}", call)
    if store.add(key + f"in/{rank}", 1) != 1:  # shut: a rank gave up before this one came
        verdict = _verdict(store, key, timeout)
        raise TimeoutError(_failed(verdict, rank, size, call, undone, timeout, late=True))
    if store.add(key + "count", 1) == size:
        store.set(key + "verdict", _MET)
        return gen
    try:
        store.wait([key + "verdict"], timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout (DistStoreError on a TCPStore)
        if store.add(key + "giveup", 1) == 1:  # the first to give up decides
            shut = [store.add(key + f"in/{r}", _SHUT) for r in range(size)]
            missing = [r for r, value in enumerate(shut) if value == _SHUT]
            verdict = {"by": rank, "missing": missing, "timeout": timeout}
            store.set(key + "verdict", json.dumps(verdict) if missing else _MET)
            if missing:
                store.add(slot + "gen", 1)  # the next call made at n: a fresh round
    verdict = _verdict(store, key, timeout)
    if verdict == _MET:
        return gen
    raise TimeoutError(_failed(verdict, rank, size, call, undone, timeout, late=False))


def _verdict(store, key: str, timeout: float) -> bytes | None:
    """The round's verdict (_MET, or the failure's JSON), None if it is not written within
    `timeout` (the deciding rank stalled between two store calls)."""
    try:
        store.wait([key + "verdict"], timedelta(seconds=timeout))
    except RuntimeError:
        return None
    return store.get(key + "verdict")


def _failed(verdict, rank, size, call, undone, timeout, late) -> str:
    """The message of a round that failed (`late`: this rank came after it did)."""
    must = f"Every rank must call it (not rank 0 alone, as on one GPU); nothing was {undone}"
    if verdict is None:
        return (
            f"{call} is collective: a rank gave up waiting for the others and did not say "
            f"which within {timeout:g} s ({TIMEOUT_ENV}). {must}"
        )
    verdict = json.loads(verdict)
    missing, waited = verdict["missing"], f"{verdict['timeout']:g} s ({TIMEOUT_ENV})"
    ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {size}"
    if late:
        return (
            f"{call} is collective: rank {verdict['by']} gave up after {waited} waiting "
            f"for {ranks}, before this rank ({rank}) called it. {must}"
        )
    return f"{call} is collective: {ranks} did not call it within {waited}. {must}"


def tidy(store, n: int, gen: int, rank: int, last: int) -> None:
    """Delete the keys no rank reads again, once call `n` is met in round `gen` (call
    n - 1 was met in round `last`): rounds n.0 to n.(gen-1), which every rank left before
    entering round n.gen, and call n - 1's, which every rank left before entering n.
    Each rank deletes its own entries, rank 0 the shared keys."""
    rounds = [(n, g) for g in range(gen)] + [(n - 1, last)] * (n > 0)
    for m, g in rounds:
        key = _ROUND.format(n=m, gen=g)
        names = [f"call/{rank}", f"in/{rank}"]
        names += ["count", "verdict", "giveup"] * (rank == 0)
        for name in names:
            store.delete_key(key + name)
    if n > 0 and rank == 0:
        store.delete_key(_SLOT.format(n=n - 1) + "gen")


# --- the directory layout: path, .NAME.tmp-ID (being written), .NAME.old-ID (set aside) --


def beside(target: Path, kind: str) -> list[Path]:
    prefix = f".{target.name}.{kind}-"
    try:
        entries = list(target.parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(p for p in entries if p.name.startswith(prefix) and p.is_dir())


def fsync_dir(directory: Path) -> None:
    """Make the names just created or renamed in `directory` durable (POSIX)."""
    if os.name != "posix":
        return  # no directory fsync there: said in docs/checkpointing.md
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(directory: Path) -> dict:
    """The completion record of `directory`, its files checked against it (present, at
    the recorded sizes). FileNotFoundError when `directory` holds no checkpoint at all,
    ValueError when it holds an incomplete or damaged one."""
    try:
        text = (directory / RECORD).read_text()
    except FileNotFoundError:
        names = [p.name for p in directory.iterdir()]
        if DCP_METADATA not in names and not any(n.endswith(".distcp") for n in names):
            raise FileNotFoundError(
                f"no checkpoint in {directory}: it holds neither a {RECORD} nor DCP's files"
            ) from None
        raise ValueError(
            f"{directory} is an incomplete checkpoint, an interrupted save: it has no "
            f"{RECORD}, which a save writes once every rank has written its files. (A "
            "checkpoint written by DCP itself or by fusedpar before its records has none "
            "either: if you know it is whole, load it with require_record=False.)"
        ) from None
    try:
        record = json.loads(text)
        files = dict(record["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{directory}/{RECORD} is not a completion record ({e})") from None
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(
                f"{directory} is incomplete: {name}, listed in its {RECORD}, is missing"
            ) from None
        if found != size:
            raise ValueError(
                f"{directory} is damaged: {name} is {found} bytes, its {RECORD} says {size}"
            )
    return record


def locate(path, require_record: bool = True) -> tuple[Path, dict | None]:
    """(the directory holding the checkpoint saved at `path`, its record): `path`, or,
    after an overwrite interrupted between its two renames, the old one set aside."""
    target = Path(path)
    if target.is_dir():
        if not require_record and not (target / RECORD).exists():
            if not (target / DCP_METADATA).is_file():
                raise FileNotFoundError(f"no checkpoint in {target}: no DCP {DCP_METADATA}")
            return target, None
        return target, read_record(target)
    if target.exists():
        raise ValueError(f"{target} is not a directory, not a checkpoint")
    asides = []
    for aside in beside(target, "old"):
        try:
            asides.append((read_record(aside).get("time", 0), aside))
        except (OSError, ValueError):
            continue
    if asides:
        aside = max(asides)[1]
        warnings.warn(
            f"an overwrite of {target} was interrupted between its two renames: "
            f"using the checkpoint it replaced, set aside as {aside} (the next "
            f"save to {target} puts a new one in place)",
            stacklevel=3,
        )
        return aside, read_record(aside)
    temps = beside(target, "tmp")
    if temps:
        state = (
            "written in full but not renamed"
            if (temps[-1] / RECORD).is_file()
            else "partly written"
        )
        raise FileNotFoundError(
            f"no checkpoint at {target}: a save into it was interrupted before it "
            f"completed ({temps[-1].name}, {state}, is left beside it; the next save to "
            f"{target} removes it)"
        )
    raise FileNotFoundError(f"no checkpoint at {target}")


def steps(root: Path) -> list[int]:
    """The N of every ``root/step-N``, and of every ``root/.step-N.old-ID`` (an overwrite
    interrupted between its renames), largest first."""
    try:
        names = [p.name for p in root.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = set()
    for name in names:
        match = STEP.fullmatch(name) or re.fullmatch(r"\.step-(\d+)\.old-\w+", name)
        if match:
            found.add(int(match[1]))
    return sorted(found, reverse=True)


def serialize(files) -> dict[str, bytes]:
    """`files` ({name: object}) as torch.save's bytes, now: training may change them."""
    blobs = {}
    for name, obj in (files or {}).items():
        plain = isinstance(name, str) and name and Path(name).name == name
        if not plain or name[0] in "._" or name == RECORD or name.endswith(".distcp"):
            raise ValueError(
                f"files: {name!r} is not a plain file name of its own (no "
                f"directories, not {RECORD}, *.distcp or starting with '.' "
                "or '_')"
            )
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        blobs[name] = buffer.getvalue()
    return blobs


def begin(target: Path, overwrite: bool, group, error) -> str:
    """The save's id, agreed by every rank (one collective); every rank raises instead
    if any rank's input was bad (`error`) or rank 0 refuses the target."""
    token = None
    if world(group)[0] == 0 and error is None:
        try:
            taken = target.exists() or beside(target, "old")
            if target.exists() and not target.is_dir():
                raise FileExistsError(f"{target} exists and is not a directory")
            if taken and not overwrite:
                aside = "" if target.exists() else " (set aside by an interrupted overwrite)"
                raise FileExistsError(
                    f"a checkpoint exists at {target}{aside}: pass overwrite=True to replace "
                    "it (atomically: it stays loadable until the new one is complete)"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            token = secrets.token_hex(4)
        except OSError as e:
            error = report(e)
    reports = gather((token, error), group)
    first_failure([e for _, e in reports], "")
    return reports[0][0]


def write_record(tmp: Path, record: dict) -> None:
    """Rank 0, once every rank's files are written: the record, atomically (a temporary
    name renamed), listing every file of the checkpoint with its size."""
    if not (tmp / DCP_METADATA).is_file():
        raise FileNotFoundError(f"DCP wrote no {DCP_METADATA} into {tmp}")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    record = {**record, "time": time.time(), "files": files}
    part = tmp / f".{RECORD}.part"
    with open(part, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / RECORD)
    fsync_dir(tmp)


def swap_in(tmp: Path, target: Path, token: str) -> None:
    """Rank 0: `tmp` becomes `target` (the old one renamed aside first, removed after)."""
    if target.exists():
        os.rename(target, target.parent / f".{target.name}.old-{token}")
        at("aside")
    os.rename(tmp, target)
    fsync_dir(target.parent)
    at("renamed")
    for leftover in beside(target, "old") + beside(target, "tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
        if leftover.exists():
            warnings.warn(f"could not remove {leftover} (it is never loaded)", stacklevel=3)


def commit(tmp: Path, target: Path, group, record: dict, blobs: dict) -> str:
    """Every rank: write this rank's `blobs`, agree that every rank's files are written;
    rank 0 writes the record and renames; every rank learns the outcome."""
    at("written")
    error = None
    try:
        for name, blob in blobs.items():
            with open(tmp / name, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = report(e)
    # the barrier: DCP's files and these are written on every rank
    first_failure(gather(error, group), f"checkpoint {target} not saved (nothing renamed)")
    outcome = None
    if world(group)[0] == 0:
        try:
            write_record(tmp, record)
            at("recorded")
            swap_in(tmp, target, record["id"])
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            outcome = report(e)
    first_failure([broadcast(outcome, group)], f"checkpoint {target} not committed")
    return str(target)
