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
"""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def _state(model: nn.Module, optimizer) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
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


def _compare(path, metadata, state: dict) -> None:
    for name, tensor in _tensors(state):
        saved = metadata.get(name)
        if saved is None:
            raise ValueError(
                f"the checkpoint at {path} has no {name} (shape {tuple(tensor.shape)})"
            )
        if not isinstance(saved, TensorStorageMetadata) or saved.size != tensor.shape:
            got = tuple(saved.size) if isinstance(saved, TensorStorageMetadata) else "no tensor"
            raise ValueError(f"{name} is {tuple(tensor.shape)} in the model but {got} in the "
                             f"checkpoint at {path}: a checkpoint of another model")  # fmt: skip


def check(path: str | os.PathLike, model: nn.Module, optimizer=None) -> None:
    """ValueError unless the checkpoint at `path` holds every tensor of `model` (and
    `optimizer`) with the same global shape. Reads the metadata only; no communication.
    An optimizer without state yet gets it (zeros, as PyTorch's state-dict API makes
    it) and, if the check fails, loses it again."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    _compare(path, metadata, {"model": get_model_state_dict(model)})
    if optimizer is None:
        return
    fresh = not optimizer.state
    try:
        _compare(path, metadata, {"optim": get_optimizer_state_dict(model, optimizer)})
    except ValueError:
        if fresh:
            optimizer.state.clear()
        raise


def load(path: str | os.PathLike, model: nn.Module, optimizer=None) -> dict:
    """Read the checkpoint at `path` into `model` (and `optimizer`), resharding to their
    layout; returns the saved `extra` dict. Collective: every rank calls it. Raises
    ValueError (every rank, nothing loaded) if the shapes do not fit."""
    check(path, model, optimizer)
    state = _state(model, optimizer)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    extra = {key.removeprefix("extra."): None for key in metadata if key.startswith("extra.")}
    if extra:
        state["extra"] = extra
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return state.get("extra", {})
