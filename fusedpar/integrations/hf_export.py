"""Back to Hugging Face: a `parallelize`d model written as the unconverted model's
checkpoint, for ``AutoModelForCausalLM.from_pretrained(dir)`` (or the classifier's Auto
class) on any machine, with or without fusedpar.

    save_pretrained(model, "out/")                # every rank; rank 0 writes
    model.save_pretrained("out/")                 # the same (set by parallelize)
    save_pretrained(model, "out/", pipeline=pipe) # under pp: the stages' parameters

Every rank calls it (a rank alone fails after ``FUSEDPAR_CHECKPOINT_TIMEOUT_S``,
`fusedpar.checkpoint.enter`). Each rank takes the full tensors of what it holds
(``DTensor.full_tensor()``) and turns the converted layers' parameters back into
Hugging Face's by the inverses beside their conversions in `hf_families`
(`dense_attention`, `dense_mla`, `dense_gdn`, `dense_kda`, ...); under pp one rank of
each stage sends its stage's to rank 0. Rank 0 loads them into a skeleton of the
original class on the meta device, checks every name and shape, and writes with Hugging
Face's own ``save_pretrained`` into a directory beside the target, moved into place when
complete. Every rank returns once written or raises the same error: a failing rank goes
on joining every gather, so none is left waiting. docs/dropin.md.
"""

import copy
import os
import pickle
import secrets
import shutil
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fusedpar import checkpoint
from fusedpar.integrations import hf_families as families
from fusedpar.nn import GatedDeltaNet, KimiDeltaAttention, MoE, ParallelAttention, ParallelMLA
from fusedpar.pipeline import PassThrough, module_at

# `model.save_pretrained`'s keywords taken (Hugging Face's others are refused by name)
METHOD_KEYWORDS = ("max_shard_size", "safe_serialization", "is_main_process", "pipeline")
CONFIG_FILES = ("config.json", "generation_config.json")  # moved into place last


@dataclass(frozen=True)
class Original:
    """What the export restores of the model `parallelize` converted: its class (FSDP2
    changes a module's class), ``config.use_cache`` before it was set False, and the
    pipeline degree (``pipeline=`` is then needed)."""

    model_class: type
    use_cache: object
    pp: int


def install(model: nn.Module, dims) -> None:
    """Called by `parallelize` before it converts `model`: keeps its `Original` and makes
    ``model.save_pretrained(dir, ...)`` call `save_pretrained` (`saving_method`)."""
    pp = 1 if dims is None else dims.pp
    model._fusedpar_original = Original(type(model), getattr(model.config, "use_cache", None), pp)
    model.save_pretrained = types.MethodType(saving_method, model)


def saving_method(model: nn.Module, save_directory, **kwargs) -> None:
    """``model.save_pretrained`` of a converted model: `save_pretrained`, taking of
    Hugging Face's keywords ``max_shard_size``, ``safe_serialization=True`` (safetensors
    is all it writes) and ``is_main_process`` (ignored: every rank calls it, rank 0
    writes), and ``pipeline``; any other raises TypeError."""
    others = sorted(set(kwargs) - set(METHOD_KEYWORDS))
    if others:
        raise TypeError(
            f"save_pretrained of a model converted by fusedpar takes "
            f"{', '.join(METHOD_KEYWORDS)}; not {', '.join(others)} (it gathers "
            "the weights itself: call it on every rank, rank 0 writes)"
        )
    if kwargs.pop("safe_serialization", True) is not True:
        raise ValueError(
            "save_pretrained of a model converted by fusedpar writes safetensors "
            "only: safe_serialization=True (or leave it out)"
        )
    kwargs.pop("is_main_process", None)
    save_pretrained(model, save_directory, **kwargs)


def save_pretrained(
    model: nn.Module, save_directory, *, pipeline=None, max_shard_size="50GB"
) -> None:
    """Write `model` (converted by `parallelize`) to `save_directory` as the original
    Hugging Face model's checkpoint (see the module doc). Collective: every rank calls
    it; rank 0 writes; every rank returns when the directory is complete, or raises the
    same error. `pipeline`: the `Pipeline` of `fusedpar.pipeline.split` (needed, and
    only taken, where `parallelize` had pp > 1). `max_shard_size`: Hugging Face's."""
    original = getattr(model, "_fusedpar_original", None)
    if original is None:
        hint = (
            " (a pipeline's stages: pass the model itself and pipeline=pipe)"
            if hasattr(model, "pipeline_layout")
            else ""
        )
        raise TypeError(
            f"save_pretrained takes a Hugging Face model converted by "
            f"fusedpar.integrations.hf.parallelize, got "
            f"{type(model).__name__}{hint}; an unconverted model saves "
            "itself: model.save_pretrained(dir)"
        )
    _check_pipeline(model, original, pipeline)
    rank = dist.get_rank() if dist.is_initialized() else 0
    checkpoint.enter(f"save_pretrained({str(save_directory)!r})", "written")
    skeleton = _skeleton(model, original)
    # the ranks that keep full tensors: rank 0; under pp the lowest rank of each stage
    mesh = getattr(getattr(model, "_fusedpar_batch", None), "mesh", None)
    lowest = None if mesh is None or pipeline is None else int(mesh.mesh.min())
    keep = rank in (0, lowest)
    root = model if pipeline is None else pipeline.model
    state, error = _held_state(root, skeleton, model.config, keep)
    if pipeline is not None:
        state, error = _collect(state, keep, _device_of(model), error)
    if rank == 0 and error is None:
        try:
            _write(skeleton, state, Path(save_directory), max_shard_size)
        except Exception as e:
            error = Failure.of(e, 0)
    _finish(error)


def _check_pipeline(model: nn.Module, original: Original, pipeline) -> None:
    if original.pp > 1 and pipeline is None:
        raise ValueError(
            f"save_pretrained: the model was parallelized with pp={original.pp}; "
            "each rank trains its stages' parameters only: pass the Pipeline "
            "of fp.pipeline.split, save_pretrained(model, dir, "
            "pipeline=pipe)"
        )
    if pipeline is None:
        return
    if original.pp == 1:
        raise ValueError("save_pretrained: pipeline= is for a model parallelized with pp > 1")
    mine = {id(p) for p in model.parameters()}
    if not all(id(p) in mine for p in pipeline.model.parameters()):
        raise ValueError(
            "save_pretrained: the pipeline's parameters are not the model's: "
            "pass the Pipeline that fp.pipeline.split made of this model"
        )


def _skeleton(model: nn.Module, original: Original) -> nn.Module:
    """The original class on the meta device, its config a copy of the model's with
    ``use_cache`` restored: the names, shapes and module kinds the export writes to."""
    config = copy.deepcopy(model.config)
    if original.use_cache is not None:
        config.use_cache = original.use_cache
    with torch.device("meta"):
        skeleton = original.model_class(config)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        skeleton.generation_config = copy.deepcopy(generation)
    return skeleton


def _own_state(module: nn.Module, prefix: str = ""):
    """(name, tensor) of `module`'s own parameters and persistent buffers."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer


def _full(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor (a DTensor's gathered over its mesh: a collective), on the CPU
    where this rank keeps it, else None."""
    with torch.no_grad():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        return whole.detach().cpu() if keep else None


def _dense(module: nn.Module, template: nn.Module, config, params: dict) -> dict:
    """A converted layer's full `params` (its names) as Hugging Face's `template` module
    holds them (its names): the inverse of the conversion `parallelize` made."""
    if isinstance(module, GatedDeltaNet):
        return families.dense_gdn(module, params)
    if isinstance(module, KimiDeltaAttention):
        return families.dense_kda(module, params)
    if isinstance(module, ParallelMLA):
        return families.dense_mla(module, config, params)
    if isinstance(module, ParallelAttention):
        return families.dense_attention(template, config, params)
    if isinstance(module, MoE):
        return families.dense_experts(template, config, params)
    return families.dense_mlp(template, config, params)  # ParallelSwiGLU, a plain MLP


@dataclass(frozen=True)
class Failure:
    """An error of the ranks that keep full tensors (an inverse, or rank 0's write),
    raised on every rank by `_finish`: where it arose, its type and message, and the
    exception itself on the rank that raised it (None once sent)."""

    rank: int
    kind: type
    message: str
    raised: BaseException | None = None

    @classmethod
    def of(cls, error: Exception, rank: int, where: str = "") -> "Failure":
        text = error.args[0] if isinstance(error, KeyError) and error.args else error
        return cls(rank, type(error), f"{where}{text}", error)

    def sent(self) -> "Failure":
        """The picklable part, for the other ranks (a type pickle cannot name: its name
        in the message of a RuntimeError)."""
        try:
            pickle.dumps(self.kind)
        except Exception:  # noqa: BLE001 - a local class, say
            return Failure(self.rank, RuntimeError, f"{self.kind.__name__}: {self.message}")
        return Failure(self.rank, self.kind, self.message)

    def exception(self, prefix: str = "") -> BaseException:
        """The error to raise: its type, with `prefix` before its message (RuntimeError
        where the type takes other arguments)."""
        try:
            return self.kind(f"{prefix}{self.message}")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            return RuntimeError(f"{prefix}{self.kind.__name__}: {self.message}")


def _held_state(root: nn.Module, skeleton: nn.Module, config, keep: bool):
    """(Hugging Face's names -> full tensors of what `root` (the converted model, or a
    pipeline's stages) holds, this rank's `Failure` or None). Every rank of a stage walks
    it in one order (each DTensor gathered over its mesh); the ranks that `keep` return
    the tensors, the others {}. A conversion that fails there is kept as the `Failure`
    (the first: no conversion after it), while the walk goes on joining every gather,
    so that no rank is left waiting in one."""
    decoder, layers_name, _ = families.TREES.get(config.model_type, families.LLAMA_TREE)
    layers = module_at(root, f"{decoder}.{layers_name}")
    units = {}  # the converted layers, by their names
    for i, layer in enumerate(layers if layers is not None else ()):
        if not isinstance(layer, PassThrough):  # another stage's block
            attention = families.mixer_name(layer, config)  # a hybrid's: per layer
            units[f"{decoder}.{layers_name}.{i}.{attention}"] = getattr(layer, attention)
            units[f"{decoder}.{layers_name}.{i}.mlp"] = layer.mlp
    state, seen, inside, failure = {}, set(), None, None
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, module in root.named_modules():
        if inside is not None and name.startswith(inside + "."):
            continue  # (a converted layer's submodules: taken with it)
        inside = None
        prefix = f"{name}." if name else ""
        if name in units:
            inside = name
            params = {}
            for sub, part in module.named_modules():
                for key, t in _own_state(part, f"{sub}." if sub else ""):
                    params[key] = _full(t, keep)
            if keep and failure is None:
                try:
                    dense = _dense(module, skeleton.get_submodule(name), config, params)
                except Exception as e:
                    kind = type(module).__name__
                    where = f"save_pretrained: {name} ({kind}) does not convert back: "
                    failure = Failure.of(e, rank, where)
                    continue
                state.update((prefix + key, t) for key, t in dense.items())
            continue
        for key, t in _own_state(module, prefix):
            if id(t) not in seen:  # a tied weight once, under its first name
                seen.add(id(t))
                whole = _full(t, keep)
                if keep:
                    state[key] = whole
    return state, failure


def _device_of(model: nn.Module) -> torch.device:
    """Where the model computes: point-to-point transfers go through there (NCCL)."""
    param = next(model.parameters())
    return param.to_local().device if isinstance(param, DTensor) else param.device


def _collect(state: dict, keep: bool, device, failure):
    """Under pipeline parallelism: rank 0 receives what it does not hold, each tensor
    from the lowest rank that keeps it (one all_gather_object of names and shapes, then
    point-to-point sends, in one order on every rank). Returns (rank 0's state, {}
    elsewhere; the first `Failure` of any rank, on every rank): where a rank failed,
    nothing is sent."""
    rank = dist.get_rank()
    table = [None] * dist.get_world_size()
    listing = {key: (tuple(t.shape), t.dtype) for key, t in state.items()} if keep else None
    dist.all_gather_object(table, (listing, failure and failure.sent()))
    failures = [failed for _, failed in table if failed is not None]
    if failures:  # (the same on every rank: no sends)
        mine = failure if failure is not None and failure.rank == failures[0].rank else None
        return {}, mine or failures[0]
    table = [names for names, _ in table]
    owner = {}
    for source, names in enumerate(table):
        for key in names or ():
            owner.setdefault(key, source)
    for key in sorted(owner):
        source = owner[key]
        if key in table[0]:
            continue
        if rank == source:
            dist.send(state[key].to(device).contiguous(), dst=0)
        elif rank == 0:
            shape, dtype = table[source][key]
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=source)
            state[key] = buffer.cpu()
    return (state if rank == 0 else {}), None


def _write(skeleton: nn.Module, state: dict, target: Path, max_shard_size) -> None:
    """Rank 0: `state` checked against the skeleton's names and shapes, loaded into it,
    written by Hugging Face's ``save_pretrained`` beside `target`, moved into place."""
    expected = skeleton.state_dict(keep_vars=True)
    tied: dict = {}  # a weight the skeleton ties (the LM head to the embeddings): one tensor
    for key, t in expected.items():
        tied.setdefault(id(t), []).append(key)
    for keys in tied.values():
        given = [key for key in keys if key in state]
        for key in keys if given else ():
            state.setdefault(key, state[given[0]])
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise RuntimeError(
            f"save_pretrained: the converted {type(skeleton).__name__} does not "
            f"map onto the original's parameters: missing {missing}, not the "
            f"original's {extra}"
        )
    for key, t in expected.items():
        if tuple(state[key].shape) != tuple(t.shape):
            raise RuntimeError(
                f"save_pretrained: {key} comes back as "
                f"{tuple(state[key].shape)}, the original's is "
                f"{tuple(t.shape)}"
            )
    skeleton.load_state_dict(
        {k: t.contiguous() for k, t in state.items()}, strict=True, assign=True
    )
    skeleton.tie_weights()
    if target.is_file():
        raise ValueError(f"save_pretrained: {target} is a file, not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
    try:
        skeleton.save_pretrained(staging, max_shard_size=max_shard_size)
        _move_into(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_into(staging: Path, target: Path) -> None:
    """`staging`'s files into `target`: a rename where `target` does not exist; else the
    weight files of an earlier save there removed, the new files moved in, the config
    last (a reader sees the old config with the new weights at worst, never a config
    without its weights)."""
    if not target.exists():
        os.replace(staging, target)
        return
    new = {p.name for p in staging.iterdir()}
    for old in target.iterdir():
        weights = old.name.startswith("model") and ".safetensors" in old.name
        if weights and old.name not in new and old.is_file():
            old.unlink()
    for path in sorted(staging.iterdir(), key=lambda p: p.name in CONFIG_FILES):
        os.replace(path, target / path.name)


def _finish(failure: Failure | None) -> None:
    """Every rank learns whether rank 0 wrote the directory: the same error everywhere
    (rank 0's `failure`: a failed conversion, or its write; under pp a stage's failed
    conversion, which `_collect` spread), or a return once it is complete (the broadcast
    closing the save). In one process: the error, raised from the original."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure.exception() from failure.raised
        return
    box = [failure and failure.sent()]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        mine = failure.raised if failure is not None and failure.rank == dist.get_rank() else None
        raise box[0].exception(f"rank {box[0].rank}: ") from mine
