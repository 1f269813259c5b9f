"""One layout's memory, per pipeline rank and the largest rank's by part (`estimate`'s
`Estimate.memory`): parameters, gradients and optimizer state (FSDP2 over dp: each
tensor's dim 0 padded and split; experts over dp ranks held or sharded as `fsdp_units`
says), the activations one microbatch saves and those the
schedule keeps in flight (from `accounting`, which the tests hold equal to the code), and
transient buffers (an estimate). Also what each pipeline rank holds (`rank_stages`), which
the step's collectives (`traffic.step`) and time take too.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from fusedpar.nn.mla import latent_moves_less
from fusedpar.parallel import ParallelDims
from fusedpar.pipeline import stage_count, stages_of
from fusedpar.plan import accounting as acc
from fusedpar.plan.model import ModelSpec
from fusedpar.plan.schedule import in_flight, simulated_count

if TYPE_CHECKING:  # annotations only: fusedpar.plan.estimate imports this module
    from fusedpar.plan.estimate import StepOptions

# FSDP2 as torchtitan runs it: MixedPrecisionPolicy(param_dtype=the compute dtype,
# reduce_dtype=float32): parameters gathered in the compute dtype, gradients reduced fp32
REDUCE_BYTES = 4


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank holds: its blocks `layers`, the embedding (`first`) and the
    head (`last`), its pipeline `stages` and each stage's rank (`stage_ranks`, by stage);
    without a pipeline, the whole model as stage 0."""

    layers: tuple[int, ...]
    first: bool
    last: bool
    stages: tuple[int, ...] = (0,)
    stage_ranks: tuple[int, ...] = (0,)


def rank_stages(
    spec: ModelSpec, dims: ParallelDims, schedule: str | None, per_rank: int = 2
) -> list[PipelineRank]:
    """Per pipeline rank: what it holds under `schedule` (`per_rank` stages a rank for a
    multi-stage schedule)."""
    if dims.pp == 1:
        return [PipelineRank(tuple(range(spec.n_layers)), True, True)]
    num = stage_count(schedule, dims.pp, per_rank)
    per_stage = spec.n_layers // num
    stages = [tuple(stages_of(schedule, rank, dims.pp, num // dims.pp)) for rank in range(dims.pp)]
    stage_ranks = {s: rank for rank in range(dims.pp) for s in stages[rank]}
    owners = tuple(stage_ranks[s] for s in range(num))
    return [
        PipelineRank(
            tuple(i for s in mine for i in range(s * per_stage, (s + 1) * per_stage)),
            0 in mine,
            num - 1 in mine,
            mine,
            owners,
        )
        for mine in stages
    ]


@lru_cache(maxsize=4096)
def fsdp_units(spec, dims, layer: int) -> tuple[tuple[str | None, list[tuple]], ...]:
    """FSDP2's units of block `layer` as `ParallelDims.fully_shard` makes them: (the data
    axis it shards over, its parameters' (local shape, kind) as `layer_tensors` gives
    them). The block over "dp"; where the EP group takes dp ranks, the routed experts
    held whole (None: EP over all of dp, FSDP2's ``ignored_params``), or the MoE module
    a unit of its own over "dp_mod_ep" (EP over part of dp: its router and shared expert
    sharded there too, replicated over "dp_in_ep")."""
    tensors = acc.layer_tensors(spec, layer, dims.tp, dims.ep_size)
    if not spec.is_moe(layer) or dims.ep_dp == 1:
        return (("dp", tensors),)
    moe = acc.moe_tensors(spec, dims.ep_size)
    rest = tensors[: len(tensors) - len(moe)]
    if dims.splits_dp:
        return (("dp", rest), ("dp_mod_ep", moe))
    experts = [t for t in moe if t[1] == "expert"]
    return (("dp", rest + [t for t in moe if t[1] != "expert"]), (None, experts))


def root_shapes(spec, rank: PipelineRank) -> list[tuple]:
    """The shapes of FSDP2's root unit: the embedding, the final norm and the head."""
    ends = acc.model_end_tensors(spec, first=rank.first, last=rank.last)
    return [(n // spec.d_model, spec.d_model) if n > spec.d_model else (n,) for n, _ in ends]


@lru_cache(maxsize=4096)
def dp_shards(spec, dims, rank: PipelineRank) -> dict:
    """Per data axis a pipeline rank's parameters are FSDP2-sharded over (`fsdp_units`;
    None: held whole): [elements this rank keeps, the blocks' units over it, the
    elements its units gather (each tensor's dim 0 padded)]. The root unit is "dp"'s,
    not counted among the units. (Cached: read it, do not change it.)"""
    out: dict = {}

    def add(group, shapes, count, unit):
        w = dims.degree(group) if group else 1
        shard = sum(acc.fsdp_numel(s, w) for s in shapes)
        entry = out.setdefault(group, [0, 0, 0])
        entry[0] += count * shard
        entry[1] += count * unit
        entry[2] += count * shard * w if group else 0

    for kind, count in Counter(spec.kind(i) for i in rank.layers).items():  # alike by kind
        layer = next(i for i in rank.layers if spec.kind(i) == kind)
        for group, tensors in fsdp_units(spec, dims, layer):
            add(group, [s for s, _ in tensors], count, 1)
    add("dp", root_shapes(spec, rank), 1, 0)
    return out


def state_bytes(spec, dims, rank: PipelineRank, *, param_dtype, optimizer) -> dict:
    """Parameters, gradients and optimizer state of a pipeline rank (FSDP2 over dp: each
    tensor's dim 0 padded and split; experts over dp ranks as `fsdp_units` says)."""
    numel = sum(held for held, _, _ in dp_shards(spec, dims, rank).values())
    tensors = sum(
        count * len(acc.layer_tensors(spec, next(i for i in rank.layers if spec.kind(i) == k)))
        for k, count in Counter(spec.kind(i) for i in rank.layers).items()
    )
    tensors += len(acc.model_end_tensors(spec, first=rank.first, last=rank.last))
    p = element_bytes(param_dtype)
    states = {"adamw": 2 * numel * p + 4 * tensors, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer must be one of {list(states)}, got {optimizer!r}")
    return {
        "parameters": numel * p,
        "gradients": numel * p,
        "optimizer": states[optimizer],
        "numel": numel,
    }


def latent_ring(spec, dims, cp_ring: str = "auto") -> bool:
    """Whether MLA's ring moves the latent (`ParallelMLA`'s choice on a GPU)."""
    if cp_ring not in ("auto", "latent", "expanded"):
        raise ValueError(f"cp_ring must be 'auto', 'latent' or 'expanded', got {cp_ring!r}")
    if not spec.mla or dims.cp == 1 or dims.ulysses > 1 or cp_ring == "expanded":
        return False
    return cp_ring == "latent" or latent_moves_less(
        spec.n_heads // dims.tp,
        spec.head_dim - spec.rope_dim,
        spec.rope_dim,
        spec.v_dim,
        spec.kv_lora_rank,
    )


def saved_peaks(
    spec, dims, z, policy, schedule, microbatches, per_rank=2, *, packed: bool = False
) -> list[int]:
    """Per pipeline rank: the most bytes of saved activations it holds at once in a step,
    the (stage, microbatch) pairs its schedule keeps in flight each counted at its stage's
    `stage_saved`, what they share (`stage_shared`; nothing when `packed` documents give
    each microbatch its own positions) once; one microbatch's without a pipeline (each
    microbatch's backward frees what its forward saved before the next one runs)."""
    if dims.pp == 1:
        return [acc.stage_saved(spec, range(spec.n_layers), z, policy, first=True, last=True)]
    num = stage_count(schedule, dims.pp, per_rank)
    size = spec.n_layers // num
    stage_bytes = {}
    for s in range(num):
        layers = range(s * size, (s + 1) * size)
        saved = acc.stage_saved(spec, layers, z, policy, first=s == 0, last=s == num - 1)
        shared = 0 if packed else acc.stage_shared(spec, layers, z, policy)
        stage_bytes[s] = (saved - shared, shared)
    simulated = simulated_count(schedule, dims.pp, microbatches, per_rank)
    peaks = in_flight(schedule, dims.pp, simulated, per_rank, stage_bytes)
    return [peaks[r] for r in range(dims.pp)]


def buffer_bytes(spec, dims, z, rank: PipelineRank) -> int:
    """Transient buffers (an estimate, not held exact by a test): FSDP's gathered block
    (this one and the prefetched next, in the compute dtype: `REDUCE_BYTES`'s note) and
    its unsharded fp32 gradient;
    TP's gathered input; the ring's K/V blocks in flight; the head's logits."""
    out = 0
    if dims.dp > 1 and rank.layers:
        block = max(  # (experts FSDP2 leaves alone are not gathered)
            sum(
                math.prod(s)
                for group, tensors in fsdp_units(spec, dims, i)
                if group
                for s, _ in tensors
            )
            for i in {spec.kind(i): i for i in rank.layers}.values()
        )
        out += block * (2 * z.e + REDUCE_BYTES)  # two gathered blocks, one's gradient
    if dims.tp > 1:
        out += z.m * spec.d_model * z.e
    if dims.cp > 1:
        hq, hkv = z.heads(spec)
        out += 2 * z.a * hkv * (spec.head_dim + spec.v_dim) * (z.e + 4)
    if rank.last:
        out += z.n * spec.vocab * (z.e + 4)
    return out


def largest(spec, dims, z: acc.Local, ranks: list[PipelineRank], opts: StepOptions) -> dict:
    """The memory by part of the pipeline rank whose peak is the largest: its state, one
    microbatch's saved activations, the pipeline's in flight beyond them, buffers (and
    unsharded parameters under "zero2" / "zero1"), one block's recompute."""
    peaks = saved_peaks(
        spec,
        dims,
        z,
        opts.checkpointing,
        opts.schedule,
        opts.microbatches,
        opts.stages_per_rank,
        packed=opts.document_len is not None,
    )
    best = None
    for rank, held in zip(ranks, peaks, strict=True):
        mem = state_bytes(spec, dims, rank, param_dtype=opts.param_dtype, optimizer=opts.optimizer)
        per_mb = acc.stage_saved(
            spec, rank.layers, z, opts.checkpointing, first=rank.first, last=rank.last
        )
        mem["activations"] = per_mb
        # the pipeline's: held stage-microbatches beyond this rank's one of each stage
        mem["in_flight"] = max(0, held - per_mb)
        mem["buffers"] = buffer_bytes(spec, dims, z, rank)
        if dims.dp > 1 and opts.dp_sharding != "zero3":  # unsharded parameters (and gradients)
            shards = dp_shards(spec, dims, rank)
            gathered = sum(whole for _, _, whole in shards.values())
            mem["buffers"] += gathered * z.e
            if opts.dp_sharding == "zero1":  # (experts FSDP2 leaves alone: whole already)
                mem["gradients"] = (gathered + shards.get(None, (0,))[0]) * 4
        recompute = 0
        if opts.checkpointing != "none" and rank.layers:
            recompute = max(acc.block_saved(spec, i, z) for i in rank.layers)
        mem["peak"] = (
            mem["parameters"]
            + mem["gradients"]
            + mem["optimizer"]
            + per_mb
            + mem["in_flight"]
            + mem["buffers"]
            + recompute
        )
        mem.pop("numel")
        if best is None or mem["peak"] > best["peak"]:
            best = mem
    return best
