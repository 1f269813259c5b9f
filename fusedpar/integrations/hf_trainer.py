"""Hugging Face's Trainer on a model `parallelize` converted: `Trainer`.

    parallelize(model, fp.ParallelDims(cp=2, tp=2))       # every rank, before the Trainer
    args = TrainingArguments(out, save_strategy="no", use_cpu=True)   # use_cpu: CPU only
    Trainer(model=model, args=args, train_dataset=data).train()       # under torchrun

A drop-in for ``transformers.Trainer`` (`ParallelTrainerMixin` puts the same changes on
another subclass, such as TRL's). It fixes what the stock Trainer gets wrong on a
converted model: no DDP wrapper (the gradients are reduced by what `fusedpar.distribute`
put on the parameters; the Trainer's own-placement path,
``is_distributed_loading_by_transformers``); batch ``i`` to dp rank ``i % dp``, the same
batch on the ranks of a cp x ulysses x tp group; token counts and batch size divided by
those ranks (`get_tp_size`); `fusedpar.clip_grad_norm_` over the DTensor gradients.

These override internals of ``transformers.Trainer`` (`INTERNALS`); where this
transformers lacks one, or no longer calls it, the Trainer refuses to be built naming it
(`missing_internals`): an unused override would scale the loss or clip wrong, silently.
What cannot work (fp16, DeepSpeed, the Trainer's FSDP, evaluation, its checkpoints, a
loss from the logits, ...) is refused when the Trainer is built (`check_trainer`).
``save_model(dir)`` calls the model's ``save_pretrained``. docs/dropin.md.
"""

import contextlib
import functools
import inspect
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
from transformers.trainer import TRAINING_ARGS_NAME

from fusedpar import comm
from fusedpar.clip import clip_grad_norm_

_NO_EVALUATION = (
    "the Trainer's evaluation gathers losses and logits over every process "
    "as if each held its own samples (the ranks of a cp x tp group hold one "
    "batch, and the logits are this rank's tokens): evaluate with "
    "model(input_ids=..., labels=...).loss under torch.no_grad()"
)


# transformers.Trainer's internals this module overrides, each with the text of its use
# in the Trainer's source (transformers/trainer.py): renamed, or no longer called, the
# override would go unused, and the loss scale (get_tp_size), the clipping or the token
# count would be silently wrong (cp x tp times). Checked when the Trainer is built.
TESTED_WITH = "5.23"
INTERNALS = {
    "_move_model_to_device": "self._move_model_to_device(",
    "get_tp_size": "self.get_tp_size()",
    "_track_num_input_tokens": "self._track_num_input_tokens(",
    "_defer_fsdp_gradient_reduction": "self._defer_fsdp_gradient_reduction",
    "_clip_grad_norm": "self._clip_grad_norm(",
    "_save": "self._save(",
    "get_train_dataloader": "self.get_train_dataloader()",
}
# the model's flag for the Trainer's path of a model that owns its placement and gradient
# reduction (set by from_pretrained(distributed_config=...) where transformers shards a
# model itself), and the Trainer's reading of it
LOADED_BY_TRANSFORMERS = "is_distributed_loading_by_transformers"
LOADED_READ = (
    f'getattr(model, "{LOADED_BY_TRANSFORMERS}"',
    f"if self.{LOADED_BY_TRANSFORMERS}:",
)


@functools.cache
def _trainer_source() -> str | None:
    """The text of the module that defines ``transformers.Trainer`` (None where its
    source is not installed: then only the names are checked)."""
    try:
        return inspect.getsource(inspect.getmodule(transformers.Trainer))
    except (OSError, TypeError):
        return None


def missing_internals(model) -> list[str]:
    """The internals of ``transformers.Trainer`` this module relies on that this
    transformers lacks or no longer calls (`INTERNALS`), and the model's flag for its
    own-placement path where the model or the Trainer no longer has it."""
    source, missing = _trainer_source(), []
    for name, use in INTERNALS.items():
        if not callable(getattr(transformers.Trainer, name, None)):
            missing.append(f"Trainer.{name} (absent)")
        elif source is not None and use not in source:
            missing.append(f"Trainer.{name} (not called: no {use!r})")
    flag = getattr(type(model), LOADED_BY_TRANSFORMERS, None)
    if not isinstance(flag, property) or not hasattr(type(model), f"_{LOADED_BY_TRANSFORMERS}"):
        missing.append(f"PreTrainedModel.{LOADED_BY_TRANSFORMERS} (absent)")
    elif source is not None and not all(use in source for use in LOADED_READ):
        missing.append(f"Trainer's {LOADED_BY_TRANSFORMERS} path (not read)")
    return missing


def _refuse(condition: bool, what: str, why: str) -> None:
    if condition:
        raise ValueError(f"fusedpar's Trainer: {what}: {why}")


def _value(option) -> str:
    """An argument as the user wrote it (TrainingArguments turns strings into enums)."""
    return getattr(option, "value", option)


def _state(model):
    """The model's `hf_batch.Batch` (how it takes its batch, its mesh and groups)."""
    state = getattr(model, "_fusedpar_batch", None)
    if state is None:
        raise TypeError(
            "fusedpar's Trainer trains a model converted by "
            "fusedpar.integrations.hf.parallelize: convert it first (an "
            "unconverted model trains with transformers.Trainer)"
        )
    return state


def check_trainer(trainer) -> None:
    """ValueError (TypeError for an unconverted model) naming what a Trainer on a
    converted model cannot do, and why. The same on every rank: it reads the arguments
    and the model, which every rank holds alike."""
    args, model = trainer.args, trainer.model
    state = _state(model)
    _refuse(
        state.kind != "full",
        "batch='local'",
        "the Trainer feeds whole batches with labels: parallelize with batch='full'",
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.mesh is None:
        _refuse(
            world > 1,
            f"a model converted with dims=None under {world} processes",
            "it would train alone on each rank: pass ParallelDims",
        )
    else:
        _refuse(
            state.mesh.size() != world,
            f"a pipeline ({world // state.mesh.size()} stages)",
            "the Trainer runs the whole model on every rank: use fp.pipeline.split "
            "and its schedule",
        )
        plain = [
            name
            for name, p in model.named_parameters()
            if p.requires_grad and not isinstance(p, DTensor)
        ]
        _refuse(
            bool(plain),
            f"parameters that are not on the mesh ({', '.join(plain[:3])})",
            "added after parallelize (an adapter?), their gradients would be averaged "
            "over every rank; add them before parallelize",
        )
    _refuse(
        args.world_size != world or args.process_index != (dist.get_rank() if world > 1 else 0),
        f"the Trainer sees {args.world_size} process(es) (accelerate's "
        f"{args.distributed_state.distributed_type if args.distributed_state else None}) "
        f"but torch.distributed has {world}",
        "launch with torchrun (accelerate reads RANK, WORLD_SIZE and LOCAL_RANK) and "
        "pass use_cpu=True on a CPU",
    )
    have = next(model.parameters()).device.type
    _refuse(
        have != args.device.type,
        f"a model on {have}",
        f"the Trainer runs on {args.device} (use_cpu=True on a CPU)",
    )
    _refuse(bool(args.deepspeed), "deepspeed", "the parameters are DTensors on fusedpar's mesh")
    _refuse(bool(args.fsdp), "fsdp", "shard over dp with dims.fully_shard before the Trainer")
    _refuse(
        getattr(args, "parallelism_config", None) is not None,
        "parallelism_config",
        "the layout is parallelize's ParallelDims",
    )
    _refuse(
        bool(args.fp16),
        "fp16",
        "its GradScaler finds infs in this rank's shards and would skip the step on "
        "some ranks only; use bf16 (no scaler) or fp32",
    )
    _refuse(
        args.label_smoothing_factor != 0,
        "label_smoothing_factor",
        "it is computed from the logits, which are this rank's tokens",
    )
    for name in ("compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"):
        _refuse(
            getattr(trainer, name, None) is not None,
            name,
            "the logits are this rank's tokens (full_logits gathers them): the "
            "model's own loss is the global one",
        )
    _refuse(
        isinstance(trainer.train_dataset, torch.utils.data.IterableDataset),
        "an iterable train_dataset",
        "the ranks of a cp x tp group must read the same "
        "batches and each dp rank its own: pass a map-style dataset",
    )
    _refuse(
        args.eval_strategy != "no", f"eval_strategy={_value(args.eval_strategy)!r}", _NO_EVALUATION
    )
    _refuse(
        not args.average_tokens_across_devices,
        "average_tokens_across_devices=False",
        "the Trainer would divide this rank's token count by the ranks sharing its batch",
    )
    _refuse(
        args.train_sampling_strategy not in ("random", "sequential"),
        f"train_sampling_strategy={args.train_sampling_strategy!r}",
        "the ranks of a batch must draw the same order: 'random' (seeded alike on every "
        "rank) or 'sequential'",
    )
    config = args.accelerator_config
    _refuse(
        bool(config.dispatch_batches) or bool(config.split_batches),
        "dispatch_batches or split_batches",
        "each dp rank takes whole batches of its own",
    )
    check_saving(args)


def check_saving(args) -> None:
    """The Trainer's checkpoints refused (checked before the Trainer is built too: its own
    refusal for the own-placement path names save_only_model, which would not do)."""
    _refuse(
        args.save_strategy != "no",
        f"save_strategy={_value(args.save_strategy)!r}",
        "the Trainer's checkpoints would hold one rank's shard of the optimizer: pass "
        "save_strategy='no' and save with fusedpar.checkpoint.save on every rank",
    )


def dp_share(model) -> tuple[int, int]:
    """(dp degree, this rank's dp index): how many different batches a step takes, and
    which is this rank's. The other axes (cp, ulysses, tp) share one batch."""
    state = _state(model)
    group = state.groups.get("dp")
    return comm.group_size(group), comm.group_rank(group)


class ParallelTrainerMixin:
    """The changes of this module to a ``transformers.Trainer`` subclass (list it first in
    the bases: ``class T(ParallelTrainerMixin, SomeTrainer)``)."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("model_init") is not None:
            raise ValueError(
                "fusedpar's Trainer: model_init: pass model=, converted once "
                "by parallelize on every rank"
            )
        model = kwargs.get("model", args[0] if args else None)
        _state(model)  # (TypeError for a model parallelize did not convert)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            check_saving(training_args)
        missing = missing_internals(model)
        if missing:
            raise RuntimeError(
                f"fusedpar's Trainer: this transformers ({transformers.__version__}) "
                f"lacks or no longer calls what it overrides: {'; '.join(missing)}; "
                f"without them its loss scale, clipping or token count would be silently "
                f"wrong. It was tested with transformers {TESTED_WITH}: install that, or "
                "train with the manual loop (docs/dropin.md)"
            )
        # The Trainer's path for a model that owns its placement and gradient reduction,
        # flagged on the model as from_pretrained(distributed_config=...) does, before the
        # Trainer reads it: no move to the device, no DDP wrapper (accelerate prepares the
        # optimizer and autocast only).
        model._is_distributed_loading_by_transformers = True
        super().__init__(*args, **kwargs)
        if getattr(self, LOADED_BY_TRANSFORMERS, None) is not True:
            raise RuntimeError(
                f"fusedpar's Trainer: this transformers ({transformers.__version__}) did "
                f"not take the model's {LOADED_BY_TRANSFORMERS} path (tested with "
                f"{TESTED_WITH})"
            )
        check_trainer(self)

    def _move_model_to_device(self, model, device):
        """The model is on its mesh's device already (a DTensor moves with its mesh):
        check the type, move nothing (the own-placement path calls this only for
        ``bf16_full_eval``/``fp16_full_eval``; `check_trainer` checks the device)."""
        have = next(model.parameters()).device.type
        _refuse(
            have != torch.device(device).type,
            f"a model on {have}",
            f"the Trainer runs on {device} (use_cpu=True on a CPU)",
        )

    def get_tp_size(self) -> int:
        """The ranks that hold the same batch (cp x ulysses x tp): the Trainer divides its
        token count and its data-parallel world by this."""
        state = _state(self.model)
        return state.ranks()

    def _dp_share(self, loader):
        """accelerate's loader, dealt over the dp ranks instead of every process."""
        if self.args.world_size == 1:
            return loader
        sampler = getattr(loader, "batch_sampler", None)
        if not (hasattr(sampler, "num_processes") and hasattr(sampler, "process_index")):
            raise ValueError(
                f"fusedpar's Trainer: accelerate's loader holds a "
                f"{type(sampler).__name__}, not its batch sampler shard: "
                "its share cannot be made the dp rank's"
            )
        sampler.num_processes, sampler.process_index = dp_share(self.model)
        return loader

    def get_train_dataloader(self):
        return self._dp_share(super().get_train_dataloader())

    def _track_num_input_tokens(self, inputs):
        """The Trainer sums each process's count: the ranks of a batch counted it alike."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self.get_tp_size()

    def evaluate(self, *args, **kwargs):
        raise ValueError(f"fusedpar's Trainer: evaluate: {_NO_EVALUATION}")

    def predict(self, *args, **kwargs):
        raise ValueError(f"fusedpar's Trainer: predict: {_NO_EVALUATION}")

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """FSDP2 over dp under gradient accumulation, where the model itself is an FSDP
        module (``dims.fully_shard(model, mesh)`` after its blocks): the Trainer enters
        this for every microbatch but the last, whose reduce-scatter then reduces them
        all (the Trainer's own reads a config that `parallelize` does not set). With only
        the blocks sharded the Trainer does not enter it: each microbatch reduce-scatters
        (the same gradients, more communication)."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _clip_grad_norm(self, model):
        """The whole model's gradient norm, clipped to max_grad_norm: each sharded
        gradient's square sum reduced over its mesh (`fusedpar.clip`: over two meshes
        too, as FSDP2 leaves them with experts over part of dp)."""
        parameters = [p for p in model.parameters() if p.grad is not None]
        return clip_grad_norm_(parameters, self.args.max_grad_norm)

    def _save(self, output_dir=None, state_dict=None):
        """``save_model``'s write, on every rank: the model's own ``save_pretrained(dir)``
        (a converted model's gathers its weights from every rank: it takes no state dict),
        then, from the writing rank, the tokenizer and the arguments beside it."""
        _refuse(
            state_dict is not None,
            "a state dict to save",
            "the converted model's save_pretrained gathers its own weights",
        )
        output_dir = self.args.output_dir if output_dir is None else output_dir
        self.model.save_pretrained(output_dir)
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        tokenizer = self.processing_class  # (a tokenizer's truth is its length: no `or`)
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        _refuse(
            bool(resume_from_checkpoint),
            "resume_from_checkpoint",
            "the Trainer's checkpoints hold one rank's shards; resume with "
            "fusedpar.checkpoint.load",
        )
        return super().train(None, *args, **kwargs)


class Trainer(ParallelTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a model converted by `parallelize` (the module doc)."""
