"""What a pipeline schedule of `fusedpar.pipeline` does on each pipeline rank, without running
it: its compute actions in order, the activations a rank holds at most, and its step time.

    actions("1F1B", pp=4, microbatches=8)[0]    # [("F", 0, 0), ..., ("B", 0, 7)]
    in_flight("DualPipeV", pp=4, microbatches=8)  # {rank: peak held (stage, microbatch)}
    simulate("GPipe", 4, 8, forward_s=1.0, backward_s=2.0)  # Timing(step_s=33.0, ...)

An action is (kind, stage, microbatch): "F" forward, "B" the whole backward, "I" and "W"
the split backward's halves (the input's gradient, sent on at once; the weights', later).
The orders are torch's own: the multi-stage schedules build theirs (``pipeline_order``,
lowered to ``pipeline_order_with_comms``, which is what runs) in the constructor, so this
module builds the schedule class on stand-in stages (`_torch_order`). GPipe and 1F1B run
a loop of their own, ``_step_microbatches``, reconstructed here (`_single`; their
``_get_pipeline_order`` drives nothing, and torch 2.13 numbers the last rank's 1F1B
forwards from 1). `in_flight` counts, per rank, the (stage, microbatch) pairs whose
forward has run and backward not finished, at its peak (or the most bytes they hold);
its values for every schedule at pp = 4 are in docs/plan.md.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

from fusedpar.pipeline import SCHEDULES, check_pipeline, stage_count, stages_of

KINDS = ("F", "B", "I", "W")


def _torch_order(schedule: str, pp: int, microbatches: int, per_rank: int) -> dict:
    """Every rank's compute actions as torch's schedule class builds them (stand-in stages:
    ``stage_index``, ``num_stages``, ``group_size``, ``group_rank``, ``is_first``,
    ``is_last``, ``submod``: what the constructors read in torch 2.13 and in the earlier
    2.x source compared; a torch whose constructor reads more raises AttributeError here)."""
    from torch import nn
    from torch.distributed.pipelining.schedules import get_schedule_class

    num_stages = pp * per_rank
    stand_ins = [
        SimpleNamespace(
            stage_index=s,
            num_stages=num_stages,
            group_size=pp,
            group_rank=0,
            is_first=s == 0,
            is_last=s == num_stages - 1,
            submod=nn.Module(),
            stage_index_to_group_rank={},
        )
        for s in stages_of(schedule, 0, pp, per_rank)
    ]
    runner = get_schedule_class(schedule)(stand_ins, microbatches)
    # what runs: the lowered order (comms and grad reductions added, compute order kept)
    order = getattr(runner, "pipeline_order_with_comms", None) or runner.pipeline_order
    out = {}
    for rank in range(pp):
        done = []
        for action in order[rank]:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                if a.computation_type.value in KINDS:  # OVERLAP_F_B: its F, then its B
                    done.append((a.computation_type.value, a.stage_index, a.microbatch_index))
        out[rank] = done
    return out


def _single(schedule: str, pp: int, microbatches: int) -> dict:
    """GPipe and 1F1B (`PipelineScheduleSingle`): stage r on rank r, the order of their
    ``_step_microbatches``. GPipe: every forward, then every backward. 1F1B: pp - r
    forwards (warm-up), then a backward and a forward in turn, then the backwards left."""
    out = {}
    for rank in range(pp):
        if schedule == "GPipe":
            out[rank] = [("F", rank, m) for m in range(microbatches)] + [
                ("B", rank, m) for m in range(microbatches)
            ]
            continue
        warmup = min(microbatches, pp - rank)
        done = [("F", rank, m) for m in range(warmup)]
        for m in range(microbatches):
            done.append(("B", rank, m))
            if warmup + m < microbatches:
                done.append(("F", rank, warmup + m))
        out[rank] = done
    return out


@functools.lru_cache(maxsize=256)
def _actions(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple:
    stages = stage_count(schedule, pp, stages_per_rank)  # ValueError for a bad schedule
    check_pipeline(schedule, pp, stages, microbatches, stages_per_rank)
    if SCHEDULES[schedule] == "single":
        order = _single(schedule, pp, microbatches)
    else:
        order = _torch_order(schedule, pp, microbatches, stages // pp)
    return tuple(tuple(order[rank]) for rank in range(pp))


def actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2
) -> dict[int, list[tuple[str, int, int]]]:
    """Per pipeline rank: its compute actions in execution order, (kind, stage, microbatch)
    with kind "F", "B" (the whole backward), "I" or "W" (the split backward's halves).
    ValueError where `fusedpar.pipeline.check_pipeline` refuses the schedule."""
    return {
        rank: list(acts)
        for rank, acts in enumerate(_actions(schedule, pp, microbatches, stages_per_rank))
    }


SIMULATED_MICROBATCHES = 32  # the planner's: beyond, the steady state's (1F1B-like schedules)


def simulated_count(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2) -> int:
    """The microbatch count the planner simulates for `microbatches`: itself up to
    SIMULATED_MICROBATCHES (or 4 per stage), else the largest valid count below (a step's
    later microbatches repeat the steady state; GPipe and LoopedBFS hold them all)."""
    stages = stage_count(schedule, pp, stages_per_rank)
    cap = max(SIMULATED_MICROBATCHES, 4 * stages)
    if microbatches <= cap or schedule in ("GPipe", "LoopedBFS"):
        return microbatches
    step = pp if schedule == "Interleaved1F1B" else 1
    return cap - cap % step


def in_flight(
    schedule: str,
    pp: int,
    microbatches: int,
    stages_per_rank: int = 2,
    stage_bytes: dict | None = None,
) -> dict[int, int]:
    """Per pipeline rank: the most (stage, microbatch) pairs whose forward has run and whose
    backward has not finished, at any point of its action list. A split backward finishes
    at W, not I: until W the stage keeps what the weights' gradient needs (its inputs and
    the graph's saved tensors, torch's ``backward_state``), so an I frees little.
    `stage_bytes` ({stage: (the bytes each microbatch of it saves, those its microbatches
    share)}): the most bytes those pairs hold at once, instead of their number."""
    weights = stage_bytes or {}
    out = {}
    for rank, acts in actions(schedule, pp, microbatches, stages_per_rank).items():
        held, per_stage, total, peak = set(), Counter(), 0, 0
        for kind, stage, mb in acts:
            each, shared = weights.get(stage, (1, 0))
            if kind == "F":
                total += each + (0 if per_stage[stage] else shared)
                held.add((stage, mb))
                per_stage[stage] += 1
                peak = max(peak, total)
            elif kind in ("B", "W") and (stage, mb) in held:
                held.remove((stage, mb))
                per_stage[stage] -= 1
                total -= each + (0 if per_stage[stage] else shared)
        out[rank] = peak
    return out


@dataclass
class Timing:
    """`simulate`'s answer: the step's makespan, the worst rank's idle fraction
    (1 - busy / step) and each rank's busy seconds."""

    step_s: float
    bubble: float
    busy_s: dict[int, float] = field(default_factory=dict)


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    *,
    forward_s: float,
    backward_s: float,
    weight_s: float | None = None,
    send_s: float = 0.0,
    stages_per_rank: int = 2,
) -> Timing:
    """The step time of `schedule` when one stage-chunk takes `forward_s` forward and
    `backward_s` backward for one microbatch (the whole backward: I + W where it is split,
    `weight_s` the W part, default half). `send_s`: an activation's or a gradient's way to
    another pipeline rank (0 between two stages of one rank).

    Each rank runs its action list in order, one action at a time, each as soon as it may:
    F(s, m) after F(s - 1, m); B or I(s, m) after its F and the B or I of (s + 1, m); W after
    its I. As in torch, the first stage's I computes nothing (no input gradient to send) and
    its W runs the whole backward. Closed form for GPipe and 1F1B at F, B: step = (m + pp -
    1)(F + B), bubble = (pp - 1) / (m + pp - 1)."""
    weight_s = backward_s / 2 if weight_s is None else weight_s
    acts = actions(schedule, pp, microbatches, stages_per_rank)
    rank_of = {s: r for r, a in acts.items() for _, s, _ in a}
    last = max(rank_of)

    def duration(kind: str, stage: int) -> float:
        if kind == "I":
            return 0.0 if stage == 0 else backward_s - weight_s
        if kind == "W":
            return backward_s if stage == 0 else weight_s
        return forward_s if kind == "F" else backward_s

    def needs(kind: str, stage: int, mb: int) -> list[tuple[tuple, float]]:
        if kind == "W":
            return [(("I", stage, mb), 0.0)]
        if kind == "F":
            if stage == 0:
                return []
            return [(("F", stage - 1, mb), send_s * (rank_of[stage - 1] != rank_of[stage]))]
        deps = [(("F", stage, mb), 0.0)]
        if stage < last:
            deps.append((("BI", stage + 1, mb), send_s * (rank_of[stage + 1] != rank_of[stage])))
        return deps

    end: dict[tuple, float] = {}  # action -> its end; ("BI", s, m): the gradient's way on
    free = dict.fromkeys(acts, 0.0)
    nxt = dict.fromkeys(acts, 0)
    busy = dict.fromkeys(acts, 0.0)
    while any(nxt[r] < len(acts[r]) for r in acts):
        progress = False
        for r in acts:
            while nxt[r] < len(acts[r]):
                kind, stage, mb = acts[r][nxt[r]]
                deps = needs(kind, stage, mb)
                if any(d not in end for d, _ in deps):
                    break
                start = max([free[r], *(end[d] + delay for d, delay in deps)])
                took = duration(kind, stage)
                free[r] = end[kind, stage, mb] = start + took
                if kind in ("B", "I"):
                    end["BI", stage, mb] = free[r]
                busy[r] += took
                nxt[r] += 1
                progress = True
        if not progress:
            stuck = {r: acts[r][nxt[r]] for r in acts if nxt[r] < len(acts[r])}
            raise RuntimeError(f"simulate: {schedule} waits for ever at {stuck}")
    step = max(free.values())
    bubble = max(1 - b / step for b in busy.values()) if step > 0 else 0.0
    return Timing(step, bubble, busy)
