"""Pipeline parallelism: fusedpar's layers inside the stages of PyTorch's schedules.

    dims = fp.ParallelDims(pp=2, tp=2)
    mesh = dims.build_mesh("cpu")                # (pp, dp, cp, tp)
    model = ParallelTransformer(reference, dims.groups(mesh))  # its stage's groups
    pipe = fp.pipeline.split(model, dims, mesh, schedule="1F1B", microbatches=4,
                             loss_fn=model.loss)
    fp.distribute(pipe.model, dims.stage_mesh(mesh))   # this rank's part, its sub-mesh
    losses = pipe.step(tokens, target=labels)    # the last stage's ranks: a loss each

`split` cuts a model whose blocks are a list (`layers`, default "blocks"; `first` and
`last` the modules before and after, None in a stage without them: torchtitan's
contract, or the model's ``pipeline_layout``) into stages for
``torch.distributed.pipelining``'s schedules. A stage module is a shallow copy holding
the model's own parameters under the unsplit names, so checkpoints load across layouts;
`Pipeline.model` holds this rank's stages (several for interleaved and V schedules).
Only the hidden state crosses stages. The batch splits into `microbatches` equal chunks
(``loss_reduction`` "mean" or "sum"); bad splits raise ValueError on every rank before
any communication, and the first step checks the ranks agree on the batch
(`fusedpar.checks`). Schedules, layouts and checks: docs/pipeline.md.
"""

import copy
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from fusedpar import checks, comm
from fusedpar.kernels.common import accumulator
from fusedpar.storage import deferred_grad_reduction

SCHEDULES = {  # name: how its stages sit on the pipeline ranks
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
LOSS_REDUCTIONS = ("mean", "sum")
DEFAULT_LAYOUT = ("blocks", ("embed",), ("norm", "head"))  # layers, first, last


class PassThrough(nn.Module):
    """A block another stage holds: its input, unchanged (no parameters)."""

    def forward(self, x, *args, **kwargs):
        return x


def stages_of(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds under `schedule`."""
    style = SCHEDULES[schedule]
    if style == "single":
        return [pp_rank]
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_count(schedule: str, pp: int, stages_per_rank: int = 2) -> int:
    """The number of stages of `schedule` at `pp` pipeline ranks (ValueError for an
    unknown schedule or a count it cannot hold per rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    style = SCHEDULES[schedule]
    if style == "v" and stages_per_rank != 2:
        raise ValueError(
            f"{schedule} holds two stages per pipeline rank (a V), not {stages_per_rank}"
        )
    if style == "loop" and stages_per_rank < 2:
        raise ValueError(
            f"{schedule} needs at least 2 stages per pipeline rank, got {stages_per_rank}"
        )
    return pp * (1 if style == "single" else stages_per_rank)


def check_pipeline(
    schedule: str,
    pp: int,
    n_layers: int,
    microbatches: int | None = None,
    stages_per_rank: int = 2,
    loss_reduction: str = "mean",
) -> int:
    """ValueError naming what does not fit; no communication. `microbatches` None: one
    per stage. Returns the stage count."""
    stages = stage_count(schedule, pp, stages_per_rank)
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    per_rank = stages // pp
    microbatches = stages if microbatches is None else microbatches
    if n_layers < stages or n_layers % stages:
        raise ValueError(
            f"{n_layers} layers do not divide into the {stages} stages of "
            f"{schedule} at pp {pp} ({per_rank} per pipeline rank): use a "
            f"multiple of {stages} layers"
        )
    if microbatches < stages:
        raise ValueError(
            f"{microbatches} microbatches for {stages} pipeline stages: a "
            f"schedule needs at least one microbatch per stage ({schedule} at "
            f"pp {pp}; fewer would leave stages waiting for ever)"
        )
    if schedule == "Interleaved1F1B" and microbatches % pp:
        raise ValueError(
            f"Interleaved1F1B takes microbatches in rounds of pp ({pp}): "
            f"{microbatches} microbatches is not a multiple"
        )
    return stages


def _shallow_copy(module: nn.Module) -> nn.Module:
    """The same submodules and parameters in a module of its own: its own slots and
    hooks (FSDP2 registers hooks on a stage's root; they must not fire for another)."""
    twin = copy.copy(module)
    twin.__dict__ = {k: v.copy() if isinstance(v, dict) else v for k, v in module.__dict__.items()}
    return twin


def module_at(root: nn.Module, path: str):
    """The module at dotted `path` under `root` (None where a stage leaves it out)."""
    module = root
    for name in path.split("."):
        module = module._modules.get(name) if module is not None else None
    return module


def _put(root: nn.Module, path: str, value, copies: dict) -> None:
    """Set dotted `path` under `root` (a stage's own copy) to `value`, shallow-copying the
    modules on the way (once each, kept in `copies`) so the model itself is untouched."""
    *parents, leaf = path.split(".")
    module, prefix = root, ""
    for name in parents:
        prefix = f"{prefix}.{name}" if prefix else name
        if prefix not in copies:
            copies[prefix] = module._modules[name] = _shallow_copy(module._modules[name])
        module = copies[prefix]
    module._modules[leaf] = value


def stage_module(model: nn.Module, stage: int, num_stages: int, layers: str, first, last):
    """A shallow copy of `model` holding stage `stage`'s blocks (the others pass through),
    the `first` modules in stage 0 and the `last` in the final stage (None elsewhere).
    Names may be dotted paths ("model.layers")."""
    blocks = module_at(model, layers)
    per_stage = len(blocks) // num_stages
    mine = range(stage * per_stage, (stage + 1) * per_stage)
    part, copies = _shallow_copy(model), {}
    _put(
        part,
        layers,
        nn.ModuleList(block if i in mine else PassThrough() for i, block in enumerate(blocks)),
        copies,
    )
    for names, holder in ((first, 0), (last, num_stages - 1)):
        for name in names:
            if stage != holder:
                _put(part, name, None, copies)
    return part


def _merged(parts: list[nn.Module], layers: str, paths) -> nn.Module:
    """One module holding every part (this rank's stages), the unsplit model's names."""
    whole, copies = _shallow_copy(parts[0]), {}
    merged = list(module_at(parts[0], layers))
    for part in parts[1:]:
        for i, block in enumerate(module_at(part, layers)):
            if not isinstance(block, PassThrough):
                merged[i] = block
        for path in paths:
            if module_at(part, path) is not None:
                _put(whole, path, module_at(part, path), copies)
    _put(whole, layers, nn.ModuleList(merged), copies)
    return whole


def _tied(model: nn.Module, first, last) -> list[nn.Parameter]:
    """Parameters both a `first` and a `last` module hold (tied embeddings)."""
    held = {id(p) for name in first for p in module_at(model, name).parameters()}
    return [p for name in last for p in module_at(model, name).parameters() if id(p) in held]


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them (see the module doc)."""

    schedule: object  # a torch.distributed.pipelining schedule
    stages: list  # this rank's PipelineStages
    stage_modules: list[nn.Module]  # their modules, in stage order
    model: nn.Module  # all of them in one module: distribute, optimize, checkpoint it
    microbatches: int
    num_stages: int
    stage_ids: list[int] = field(default_factory=list)
    tied: list = field(default_factory=list)  # held by the first and last stage's ranks
    pp_group: object = None
    check_groups: list = field(default_factory=list)  # pp, cp, ulysses, tp: one batch
    # the model's own checks of a step's batch that a rank makes alone (its
    # ``check_step(inputs, kwargs, microbatches)``): at the first step, before the schedule
    check_step: object = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(self, *inputs, target=None, **kwargs) -> list | None:
        """One forward and backward of the batch through the schedule: `inputs` go to the
        first stage, `kwargs` to every stage (a packed batch's position_ids, say),
        `target` to `loss_fn` on the last (every rank passes the same batch; each uses
        its part). Returns the microbatches' losses on the ranks of the last stage, None
        elsewhere. Gradients accumulate in the parameters, as backward's do."""
        named = (
            *((f"input {i}", t) for i, t in enumerate(inputs)),
            *kwargs.items(),
            ("target", target),
        )
        tensors = [(what, t) for what, t in named if isinstance(t, torch.Tensor)]
        verdict = checks.Verdict()
        verdict.run(self._check_batch, tensors)
        if checks.due(self, *(t for _, t in tensors)):
            if self.check_step is not None and verdict.error is None:
                verdict.run(self.check_step, inputs, kwargs, self.microbatches)
            self._agree_on_batch(tensors, verdict)  # raises on every rank of the pipeline
            checks.passed(self)
        verdict.reraise()
        # contiguous: torch 2.11's stages check each microbatch's strides against the
        # first's (a sliced batch, tokens[:, :-1], failed there)
        inputs = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs)
        kwargs = {
            k: t.contiguous() if isinstance(t, torch.Tensor) else t for k, t in kwargs.items()
        }
        target = target.contiguous() if isinstance(target, torch.Tensor) else target
        losses = [] if self.has_last else None
        args = inputs if self.has_first else ()
        # the partial gradients of whole parameters are summed once, after the step, in
        # one order on every rank (the split backwards accumulate in no fixed order)
        with deferred_grad_reduction(self.model):
            self.schedule.step(
                *args,
                target=target if self.has_last else None,
                losses=losses,
                return_outputs=False,
                **kwargs,
            )
        self._sum_tied_grads()
        return losses

    def _check_batch(self, tensors) -> None:
        """What this rank alone can see is wrong with its batch: a tensor whose dim 0 does
        not split into the microbatches, or tensors of different batch sizes."""
        for what, t in tensors:
            if t.dim() == 0 or t.shape[0] % self.microbatches:
                raise ValueError(
                    f"pipeline step: {what} {tuple(t.shape)} does not split into "
                    f"{self.microbatches} microbatches along dim 0 (the batch)"
                )
        sizes = {what: t.shape[0] for what, t in tensors}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"pipeline step: the batch sizes (dim 0) differ: {sizes}")

    def _agree_on_batch(self, tensors, verdict) -> None:
        """The first step's check (`fusedpar.checks`): the ranks of the pipeline gather
        their microbatch count, batch size (-1: none given, as the middle stages under
        torch's convention) and the verdict of their own checks (`_check_batch`); then
        every rank raises the same ValueError: a rank's refusal, naming it (`settle`), or
        the ranks whose counts or sizes differ."""
        batch = tensors[0][1].shape[0] if tensors and verdict.error is None else -1
        device = self.stages[0].device if self.stages else "cpu"
        exchange = functools.partial(checks.gather, self.check_groups, device=device)
        table = exchange([self.microbatches, batch, *verdict.codes()])
        checks.settle(verdict, {rank: row[2:] for rank, row in table.items()}, exchange)
        # (the microbatch count of every rank; the batch size of those given one)
        for index, what in ((0, "microbatch counts"), (1, "batch sizes")):
            seen: dict[int, list] = {}
            for rank, row in table.items():
                if row[index] >= 0:
                    seen.setdefault(row[index], []).append(rank)
            if len(seen) > 1:
                listed = "; ".join(
                    f"{checks.ranks_text(ranks)}: {value}" for value, ranks in seen.items()
                )
                raise ValueError(
                    f"pipeline step: the ranks of this pipeline have different {what} "
                    f"({listed}): every rank of a pipeline (its stages, and their cp and tp "
                    "ranks) takes a batch of one size, split alike"
                )

    def _sum_tied_grads(self) -> None:
        """A tied embedding's gradient is the sum of the first stage's (embedding) and the
        last's (head), which different pipeline ranks hold: one all-reduce over pp."""
        import torch.distributed as dist

        mine = {id(p) for p in self.model.parameters()}
        for param in self.tied:
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local is None:
                local = torch.zeros_like(param.to_local() if hasattr(param, "to_local") else param)
            dist.all_reduce(local, group=self.pp_group)
            if grad is None and id(param) in mine:
                param.grad = local


def split(
    model: nn.Module,
    dims,
    mesh,
    *,
    schedule: str = "1F1B",
    microbatches=None,
    loss_fn=None,
    loss_reduction: str = "mean",
    stages_per_rank: int = 2,
    layers: str | None = None,
    first=None,
    last=None,
) -> Pipeline:
    """Cut `model` into the stages of `schedule` over the "pp" axis of `mesh` and build
    the schedule (see the module doc). `microbatches` defaults to the number of stages.
    Every rank builds the whole model (with its stage's groups) and calls this.

    `layers`, `first` and `last` (dotted paths allowed) default to the model's
    ``pipeline_layout`` if it has one, else ("blocks", ("embed",), ("norm", "head")). A
    model converted by `fusedpar.integrations.hf.parallelize` is taken as it is: its
    ``fusedpar_pipeline_stages()`` (set by `parallelize`: `hf_pipeline.DecoderStages`)
    is what runs as the stages, `loss_fn` defaulting to that module's ``loss``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        get_schedule_class,
    )

    stages = getattr(model, "fusedpar_pipeline_stages", None)
    if callable(stages):  # a model that says what runs as its stages (parallelize's)
        model = stages()
        loss_fn = model.loss if loss_fn is None else loss_fn
    default = getattr(model, "pipeline_layout", DEFAULT_LAYOUT)
    given = (layers, first, last)
    layers, first, last = (g if g is not None else d for g, d in zip(given, default, strict=True))
    blocks = module_at(model, layers)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"split: {type(model).__name__}.{layers} must be an nn.ModuleList of "
            f"the blocks, got {type(blocks).__name__}"
        )
    for name in (*first, *last):
        if not isinstance(module_at(model, name), nn.Module):
            raise ValueError(f"split: {type(model).__name__} has no module {name!r}")
    own = [name for name, p in model._parameters.items() if p is not None]
    if own:
        raise ValueError(
            f"split: {type(model).__name__} holds parameters of its own "
            f"({', '.join(own)}), which no one stage would hold: put them in a "
            "submodule of first or last"
        )
    groups = dims.groups(mesh)
    pp_group = groups["pp"]
    pp, pp_rank = comm.group_size(pp_group), comm.group_rank(pp_group)
    num_stages = stage_count(schedule, pp, stages_per_rank)
    microbatches = num_stages if microbatches is None else microbatches
    check_pipeline(schedule, pp, len(blocks), microbatches, stages_per_rank, loss_reduction)
    tied = [] if pp == 1 else _tied(model, first, last)
    if SCHEDULES[schedule] == "v" and tied:
        # measured: the tied weight's gradient 5e-2 off (GPT-2, ZBVZeroBubble and DualPipeV)
        raise ValueError(
            f"split: {schedule} puts the first and the last stage on one rank, "
            "and torch's split backward (input, then weight) gets a weight "
            "that two stages of a rank share wrong: untie the embeddings "
            "(tie_word_embeddings=False) or take another schedule"
        )
    per_rank = num_stages // pp
    stage_ids = stages_of(schedule, pp_rank, pp, per_rank)
    parts = [stage_module(model, s, num_stages, layers, first, last) for s in stage_ids]
    device = next(model.parameters()).device
    group = None if pp_group is None else pp_group.get_group()
    stages = [
        PipelineStage(part, s, num_stages, device, group=group)
        for part, s in zip(parts, stage_ids, strict=True)
    ]
    cls = get_schedule_class(schedule)
    scale = loss_reduction == "mean"
    if issubclass(cls, PipelineScheduleSingle):
        runner = cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale)
    else:
        runner = cls(stages, microbatches, loss_fn=loss_fn, scale_grads=scale)
    merged = _merged(parts, layers, (*first, *last))
    if tied and num_stages - 1 in stage_ids and 0 not in stage_ids:
        # the ranks of the last stage hold a tied weight under the first stage's name (the
        # unsplit model's first), so the optimizer's state has one name in a checkpoint
        ids = {id(p) for p in tied}
        for name in first:
            if any(id(p) in ids for p in module_at(model, name).parameters()):
                _put(merged, name, module_at(model, name), {})
    check_groups = [groups[axis] for axis in ("pp", "cp", "ulysses", "tp")]
    return Pipeline(
        runner,
        stages,
        parts,
        merged,
        microbatches,
        num_stages,
        stage_ids,
        tied,
        group,
        check_groups,
        getattr(model, "check_step", None),
    )


def stage_losses_total(losses: list | None, reduction: str = "mean", device=None):
    """This rank's share of the batch loss from `Pipeline.step`'s losses (0 off the last
    stage): their mean (or sum), to be summed over the ranks as the model's shares are."""
    if not losses:
        return torch.zeros((), device=device)
    stacked = torch.stack([loss.detach().to(accumulator(loss.dtype)) for loss in losses])
    return stacked.mean() if reduction == "mean" else stacked.sum()
