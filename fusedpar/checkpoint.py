"""Distributed checkpoints of a model (and its optimizer) that load at any other layout.

    fp.checkpoint.save(path, model, optimizer, extra={"step": step})
    extra = fp.checkpoint.load(path, model, optimizer)   # {"step": step}

A thin layer over ``torch.distributed.checkpoint`` (DCP): ``get_model_state_dict`` /
``get_optimizer_state_dict`` on save, ``set_*`` after load. With every parameter a
DTensor on the full mesh (`fusedpar.distribute`, with or without FSDP2), DCP writes each
shard with its offset in the global tensor, so a checkpoint saved at (dp=2, tp=2) loads
at (dp=1, tp=4), at (tp=2, cp=2) or on one rank, parameters and optimizer moments alike.

`load` first compares the global shape of every tensor of the model and optimizer with
the checkpoint's metadata, on every rank and without communication, and raises
ValueError naming the first that differs or is missing: a checkpoint of another model
fails on every rank before anything is read, and nothing is half-loaded. `extra` is
small picklable state (the step, a data-loader position), saved once.

Under pipeline parallelism each rank saves and loads its stages' part of the model
(`fusedpar.pipeline.Pipeline.model`), whose names are the unsplit model's: a checkpoint
written at PP2 x TP2 loads at PP1 x CP2 x TP2 and back. `load` then refuses a tensor of
the checkpoint only if no rank's part holds it.
"""

import os

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

# The optimizer's param groups saved per parameter ("param_groups.<name>.lr"), not per
# group index: pipeline ranks hold different parameters in their group 0, and DCP keeps
# one rank's copy of a key. Checkpoints of the earlier, per-index form still load.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
BY_GROUP = StateDictOptions(flatten_optimizer_state_dict=False)


def _options(metadata) -> StateDictOptions:
    """The optimizer layout of a checkpoint (`FLAT` for a new one, None metadata)."""
    legacy = metadata is not None and any(k.startswith("optim.param_groups.0.") for k in metadata)
    return BY_GROUP if legacy else FLAT


def _state(model: nn.Module, optimizer, options: StateDictOptions = FLAT) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    return state


def save(path: str | os.PathLike, model: nn.Module, optimizer=None, *, extra=None) -> None:
    """Write `model`'s (and `optimizer`'s) state and the picklable dict `extra` to the
    directory `path`. Collective: every rank calls it."""
    state = _state(model, optimizer)
    if extra is not None:
        state["extra"] = dict(extra)
    dcp.save(state, checkpoint_id=path)


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
            raise ValueError(f"{name} is {tuple(tensor.shape)} in the model but {got} in the "
                             f"checkpoint at {path}: a checkpoint of another model")  # fmt: skip
    prefix = next(iter(state)) + "."
    return sorted(k for k in metadata if k.startswith(prefix) and k not in names
                  and isinstance(metadata[k], TensorStorageMetadata))  # fmt: skip


def _refuse_unknown(path, unknown) -> None:
    if unknown:
        unknown = sorted(unknown)
        raise ValueError(f"the checkpoint at {path} has {unknown[0]}, which the model does "
                         f"not ({len(unknown)} such tensors): a checkpoint of another "
                         "model")  # fmt: skip


def _metadata(path) -> dict:
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def check(path: str | os.PathLike, model: nn.Module, optimizer=None, *, metadata=None,
          part: bool = False) -> list[str]:  # fmt: skip
    """ValueError unless the checkpoint at `path` holds exactly the tensors of `model`
    (and `optimizer`), with the same global shapes. ``part``: `model` is one part of the
    model (a pipeline rank's stages, `fusedpar.pipeline`): the checkpoint's other
    tensors are returned rather than refused. Reads the metadata only (unless given); no
    communication; leaves an optimizer without state without state."""
    metadata = _metadata(path) if metadata is None else metadata
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


def _agree(path, error: Exception | None, unknown: list[str]) -> None:
    """Every rank raises if any rank failed its check (a rank that raised alone would
    leave the others waiting in DCP's collectives), or if a tensor of the checkpoint is
    in no rank's part of the model (pipeline stages hold different tensors)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        _refuse_unknown(path, unknown)
        return
    reports = [None] * dist.get_world_size()
    message = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(reports, (message, unknown))
    failed = [(rank, e) for rank, (e, _) in enumerate(reports) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"cannot load (rank {rank}): {message}") from error
    _refuse_unknown(path, set.intersection(*(set(names) for _, names in reports)))


def load(path: str | os.PathLike, model: nn.Module, optimizer=None) -> dict:
    """Read the checkpoint at `path` into `model` (and `optimizer`), resharding to their
    layout; returns the saved `extra` dict. Collective: every rank calls it. If the
    checkpoint does not fit (or a rank cannot read it), every rank raises ValueError
    before anything is read."""
    error, unknown, metadata = None, [], {}
    try:
        metadata = _metadata(path)
        unknown = check(path, model, optimizer, metadata=metadata, part=True)
    except Exception as e:  # noqa: BLE001 - handed to every rank by _agree
        error = e
    _agree(path, error, unknown)
    options = _options(metadata)
    state = _state(model, optimizer, options)
    extra = {key.removeprefix("extra."): None for key in metadata if key.startswith("extra.")}
    if extra:
        state["extra"] = extra
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    return state.get("extra", {})
