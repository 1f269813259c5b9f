"""Distributed checkpoints of a model (and its optimizer) that load at any other layout,
complete or refused.

    fp.checkpoint.save(path, model, optimizer, extra={"step": step})
    extra = fp.checkpoint.load(path, model, optimizer)   # {"step": step}
    path = fp.checkpoint.latest(root)                   # root/step-N: the largest N complete
    pending = fp.checkpoint.save(path, model, optimizer, async_save=True)  # training goes on
    pending.wait()                                      # (or the next save waits for it)

A thin layer over ``torch.distributed.checkpoint`` (DCP) for a model whose parameters
are DTensors on the full mesh (`fusedpar.distribute`): a checkpoint saved at (dp=2,
tp=2) loads at (dp=1, tp=4), (tp=2, cp=2), one rank, or another pipeline layout.
A save is atomic (a temporary directory beside `path`, the completion record `RECORD`
written by rank 0, then a rename); `load` refuses a directory without the record and
checks every tensor's global shape before reading anything. `save` and `load` are
collective: a rank that does not join within ``FUSEDPAR_CHECKPOINT_TIMEOUT_S`` (default
120 s) is named in a TimeoutError on the others (`checkpoint_files.enter`).
Details: docs/checkpointing.md.
"""

import inspect
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fusedpar import checkpoint_files as atomic

# The optimizer's param groups saved per parameter ("param_groups.<name>.lr"), not per
# group index: pipeline ranks hold different parameters in their group 0, and DCP keeps
# one rank's copy of a key. Checkpoints of the earlier, per-index form still load.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
BY_GROUP = StateDictOptions(flatten_optimizer_state_dict=False)
RECORD = atomic.RECORD  # "complete.json": the completion record inside a checkpoint


def _options(metadata) -> StateDictOptions:
    """The optimizer layout of a checkpoint (`FLAT` for a new one, None metadata)."""
    legacy = metadata is not None and any(k.startswith("optim.param_groups.0.") for k in metadata)
    return BY_GROUP if legacy else FLAT


def _state(model: nn.Module, optimizer, options: StateDictOptions = FLAT) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    return state


_ASYNC_GROUP = None  # (the default group it was made for, a gloo group of every rank)


def _async_group():
    """A gloo group of every rank, made once per default group, for the collectives of
    asynchronous saves: they run in background threads, and a training group's
    collectives must keep one order on every rank."""
    global _ASYNC_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not world:
        _ASYNC_GROUP = (world, dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[1]


def resolve(path: str | os.PathLike) -> str:
    """The directory that holds the complete checkpoint saved at `path`: `path` itself,
    or, when an overwrite of it was interrupted between its two renames, the checkpoint
    it replaced, set aside beside it (``.NAME.old-ID``; with a warning). Raises as
    `load` does otherwise: FileNotFoundError (nothing there, or only an interrupted
    save's temporary directory), ValueError (incomplete). No communication."""
    return str(atomic.locate(path)[0])


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under `root`: of the directories ``root/step-N``,
    the one with the largest N whose save completed (as `resolve` gives it), or None
    when there is none. Other names are not considered; a ``step-N`` that is not
    complete is skipped with a warning (interrupted saves are never visible under that
    name: they are a checkpoint of DCP's own or an older fusedpar). No communication:
    `load` checks that every rank found the same one."""
    root = Path(root)
    found, skipped = None, []
    for step in atomic.steps(root):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the aside is latest's answer, not news
                found = str(atomic.locate(root / f"step-{step}")[0])
            break
        except (OSError, ValueError) as e:
            if (root / f"step-{step}").exists():
                skipped.append((step, e))
    if skipped:
        names = ", ".join(f"step-{step}" for step, _ in skipped)
        warnings.warn(
            f"latest({root}): no complete checkpoint among {names}, newer than "
            f"{Path(found).name if found else 'none'}: {skipped[0][1]}",
            stacklevel=2,
        )
    return found


# --- save ------------------------------------------------------------------------------


class AsyncSave:
    """A checkpoint being written in the background (``save(..., async_save=True)``).

    Its files are written by DCP's thread and committed (every rank's files written,
    the record, the rename) by another, on a gloo group of its own: nothing runs on the
    training's groups. `wait()` blocks until the checkpoint is complete and visible at
    `path` and returns `path`, or raises what the save raised; `done()` says whether
    that has happened. The next `save` or `load` waits for it first. Call `wait()`
    before ``destroy_process_group``: a save whose group is gone stays invisible."""

    def __init__(self, path: str, future: Future):
        self.path, self._future, self._seen = path, future, False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        try:
            self._future.result(timeout)
        except Exception:
            self._seen = self._future.done()  # its error seen: the next save goes on
            raise
        return self.path


_PENDING: AsyncSave | None = None  # this process's asynchronous save in flight


def _finish_pending() -> None:
    """Wait for this process's asynchronous save; raise its error unless `wait` did."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None or pending._seen:
        return
    try:
        pending._future.result()
    except Exception as e:
        raise RuntimeError(f"the asynchronous save to {pending.path} failed: {e}") from e


def _own_storage(state: dict) -> None:
    """Give each DTensor whose local tensor starts past the start of its storage (a
    shard that is a view) a storage of its own, in place: torch 2.13's stager copies such
    a tensor from the DTensor's own storage, which is none ("invalid python storage")."""
    for key, value in state.items():
        if isinstance(value, dict):
            _own_storage(value)
        elif isinstance(value, DTensor) and value.to_local().storage_offset() != 0:
            state[key] = DTensor.from_local(
                value.to_local().clone(),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )


def _async_save(state: dict, tmp: Path, group) -> Future:
    """DCP's async_save on `group` (staged into host memory before it returns, written by
    a thread); the future of the writes. torch 2.11 to 2.13 return a Future, or an
    AsyncSaveResponse whose upload_completion is that future."""
    _own_storage(state)
    kwargs = {"checkpoint_id": str(tmp), "process_group": group}
    kind = getattr(dcp.state_dict_saver, "AsyncCheckpointerType", None)
    takes = inspect.signature(dcp.async_save).parameters
    if kind is not None and "async_checkpointer_type" in takes:
        kwargs["async_checkpointer_type"] = kind.THREAD  # its thread runs on our group
    response = dcp.async_save(state, **kwargs)
    return getattr(response, "upload_completion", response)


def enter(call: str, undone: str = "written") -> None:
    """Wait until every rank has called `call` (its name in the message), at most
    ``FUSEDPAR_CHECKPOINT_TIMEOUT_S`` (default 120), else TimeoutError naming the ranks
    that did not and saying that nothing was `undone`. Every rank that called it gets
    the same outcome (one that comes just after another gave up raises too). No
    collective (the default group's store): the first step of `save`, `load` and
    `fusedpar.integrations.hf.save_pretrained`, where a rank calling alone would wait
    for ever in the first collective."""
    atomic.enter(call, undone)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer=None,
    *,
    extra=None,
    files: dict | None = None,
    overwrite: bool = False,
    async_save: bool = False,
) -> AsyncSave | None:
    """Write `model`'s (and `optimizer`'s) state and the picklable dict `extra` to the
    directory `path`, atomically: complete there once this returns (or, with
    ``async_save``, once the returned `AsyncSave` is done), invisible before. Collective:
    every rank calls it. Where the world spans nodes, `path` is on a file system they
    share (as DCP's file storage needs).

    ``files``: ``{name: object}`` written with torch.save into the checkpoint by the
    calling rank (typically rank 0's own state), serialized when called.
    ``overwrite``: replace a checkpoint at `path` (it stays loadable until the new one is
    complete); without it an existing `path` raises FileExistsError on every rank.
    ``async_save``: stage the state in host memory (DCP's async_save) and return; the
    files are written and the checkpoint committed in the background. Errors are raised
    on every rank; a save that fails leaves `path` as it was. A rank that calls it alone
    raises TimeoutError after ``FUSEDPAR_CHECKPOINT_TIMEOUT_S`` (default 120 s), naming
    the ranks that did not call it, with nothing written (not even `path`'s parent)."""
    atomic.enter("fp.checkpoint.save", "written")  # before anything written, any collective
    _finish_pending()
    target = Path(path)
    state, blobs, error = _state(model, optimizer), {}, None
    if extra is not None:
        state["extra"] = dict(extra)
    try:
        blobs = atomic.serialize(files)
    except Exception as e:  # noqa: BLE001 - raised on every rank by atomic.begin
        error = atomic.report(e)
    group = _async_group() if async_save else None
    token = atomic.begin(target, overwrite, group, error)
    tmp = target.parent / f".{target.name}.tmp-{token}"
    step = (extra or {}).get("step")
    record = {
        "format": atomic.FORMAT,
        "id": token,
        "world_size": atomic.world()[1],
        "step": step if isinstance(step, int) else None,
        "async": async_save,
        "torch": torch.__version__,
    }
    if not async_save:
        dcp.save(state, checkpoint_id=str(tmp))
        atomic.commit(tmp, target, group, record, blobs)
        return None
    written = _async_save(state, tmp, group)

    def finish() -> str:
        written.result()  # DCP's writes, on every rank (its own collectives agree on errors)
        return atomic.commit(tmp, target, group, record, blobs)

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusedpar-checkpoint")
    future = executor.submit(finish)
    executor.shutdown(wait=False)  # the thread ends with the save
    global _PENDING
    _PENDING = AsyncSave(str(target), future)
    return _PENDING


# --- load ------------------------------------------------------------------------------


def _tensors(tree, prefix: str = ""):
    """(DCP's flattened key, tensor) for every tensor in nested dicts."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, dict):
            yield from _tensors(value, name + ".")


def _compare(path, metadata, state: dict) -> list[str]:
    """Raise for a tensor of `state` the checkpoint lacks or holds at another shape;
    return the checkpoint's tensors (under the state's prefix) that `state` lacks."""
    names = set()
    for name, tensor in _tensors(state):
        names.add(name)
        saved = metadata.get(name)
        if saved is None:
            raise ValueError(
                f"the checkpoint at {path} has no {name} (shape {tuple(tensor.shape)})"
            )
        if not isinstance(saved, TensorStorageMetadata) or saved.size != tensor.shape:
            got = tuple(saved.size) if isinstance(saved, TensorStorageMetadata) else "no tensor"
            raise ValueError(
                f"{name} is {tuple(tensor.shape)} in the model but {got} in the "
                f"checkpoint at {path}: a checkpoint of another model"
            )
    prefix = next(iter(state)) + "."
    return sorted(
        k
        for k in metadata
        if k.startswith(prefix)
        and k not in names
        and isinstance(metadata[k], TensorStorageMetadata)
    )


def _refuse_unknown(path, unknown) -> None:
    if unknown:
        unknown = sorted(unknown)
        raise ValueError(
            f"the checkpoint at {path} has {unknown[0]}, which the model does "
            f"not ({len(unknown)} such tensors): a checkpoint of another "
            "model"
        )


def _metadata(path) -> dict:
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def check(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer=None,
    *,
    metadata=None,
    part: bool = False,
    require_record: bool = True,
) -> list[str]:
    """ValueError unless the checkpoint at `path` holds exactly the tensors of `model`
    (and `optimizer`), with the same global shapes. ``part``: `model` is one part of the
    model (a pipeline rank's stages, `fusedpar.pipeline`): the checkpoint's other
    tensors are returned rather than refused. Reads the metadata only (unless given), of
    a complete checkpoint (`resolve`; ``require_record=False`` also takes one without a
    record); no communication; leaves an optimizer without state without state."""
    if metadata is None:
        metadata = _metadata(atomic.locate(path, require_record)[0])
    unknown = _compare(path, metadata, {"model": get_model_state_dict(model)})
    if optimizer is not None:
        fresh = not optimizer.state
        try:  # PyTorch's state-dict API gives a fresh optimizer state (zeros, step 1) to read
            options = _options(metadata)
            state = {"optim": get_optimizer_state_dict(model, optimizer, options=options)}
            unknown += _compare(path, metadata, state)
        finally:
            if fresh:
                optimizer.state.clear()
    if not part:
        _refuse_unknown(path, unknown)
    return unknown


def _agree(path, error: Exception | None, unknown: list[str], save_id=None) -> None:
    """Every rank raises if any rank failed its check (a rank that raised alone would
    leave the others waiting in DCP's collectives), if the ranks found different saves
    at `path` (`save_id`, from the records), or if a tensor of the checkpoint is in no
    rank's part of the model (pipeline stages hold different tensors)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        _refuse_unknown(path, unknown)
        return
    reports = [None] * dist.get_world_size()
    message = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(reports, (message, unknown, save_id))
    failed = [(rank, e) for rank, (e, _, _) in enumerate(reports) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"cannot load (rank {rank}): {message}") from error
    ids = [save_id for _, _, save_id in reports]
    if len(set(ids)) > 1:
        other = next(rank for rank, i in enumerate(ids) if i != ids[0])
        raise ValueError(
            f"cannot load {path}: the ranks found different saves there (rank 0: "
            f"{ids[0]}, rank {other}: {ids[other]}); give every rank the same "
            "checkpoint, on a file system they share"
        )
    _refuse_unknown(path, set.intersection(*(set(names) for _, names, _ in reports)))


def load(
    path: str | os.PathLike, model: nn.Module, optimizer=None, *, require_record: bool = True
) -> dict:
    """Read the checkpoint at `path` into `model` (and `optimizer`), resharding to their
    layout; returns the saved `extra` dict. Collective: every rank calls it. If the
    checkpoint is not complete (no record: an interrupted save), is missing, does not
    fit, or a rank cannot read it or finds another save there, every rank raises
    ValueError before anything is read. ``require_record=False`` also loads a DCP
    checkpoint without a record (DCP's own, or fusedpar's before records): nothing then says
    whether it is whole. A rank that calls it alone raises TimeoutError after
    ``FUSEDPAR_CHECKPOINT_TIMEOUT_S`` (default 120 s), naming the ranks that did not."""
    atomic.enter("fp.checkpoint.load", "read")  # before anything read, any collective
    _finish_pending()
    error, unknown, metadata, where, save_id = None, [], {}, None, None
    try:
        where, record = atomic.locate(path, require_record)
        save_id = None if record is None else record.get("id")
        metadata = _metadata(where)
        unknown = check(path, model, optimizer, metadata=metadata, part=True)
    except Exception as e:  # noqa: BLE001 - handed to every rank by _agree
        error = e
    _agree(path, error, unknown, save_id)
    options = _options(metadata)
    state = _state(model, optimizer, options)
    extra = {key.removeprefix("extra."): None for key in metadata if key.startswith("extra.")}
    if extra:
        state["extra"] = extra
    dcp.load(state, checkpoint_id=str(where))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    return state.get("extra", {})
