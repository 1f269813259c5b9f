"""Every layout of N GPUs, estimated and ranked: `search`.

A layout is degrees (pp, dp, cp, ulysses, tp) whose product is the GPU count, and for
a MoE model an EP run of the (dp, cp, ulysses, tp) axes, over all of dp or its inner
ranks (`ep_degree`: the most inside a node and the most of all), its group dividing
the experts and at most `MAX_EP` ranks. For
each, the search keeps the fastest of: microbatch sizes, the pipeline schedules, and the
checkpointing policies from the cheapest ("none") to "full", the first that fits, and
FSDP2 resharding every microbatch ("zero3") or holding the gathered parameters through
a step ("zero1"). A
layout none of whose choices is possible is ruled out with the reason: a degree that
does not divide the heads, the experts, the layers or the batch, or the memory it lacks
at its best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations, product

import torch

from fusedpar.parallel import ParallelDims
from fusedpar.plan.accounting import POLICIES, check_heads
from fusedpar.plan.estimate import Estimate, estimate
from fusedpar.plan.model import model_spec

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
MIN_TOKENS_PER_CP_RANK = 512  # shorter shards leave the ring's steps all latency
MAX_EP = 64  # the largest EP group over dp ranks searched (published runs: 32-64)


@dataclass
class SearchResult:
    ranked: list[Estimate] = field(default_factory=list)  # fits, fastest first
    out_of_memory: list[Estimate] = field(default_factory=list)  # the best try of each
    ruled_out: list[tuple[str, str]] = field(default_factory=list)  # (layout, why)

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(spec, gpus: int, gpus_per_node: int, seq_len: int, skipped=None):
    """Candidate ParallelDims (EP variants included) for `gpus`; those not worth an
    estimate go to `skipped` as (layout, why)."""
    for tp in _divisors(math.gcd(gpus, gpus_per_node)):  # TP inside a node
        for ulysses in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * ulysses)):
                for pp in _divisors(gpus // (tp * ulysses * cp)):
                    dp = gpus // (tp * ulysses * cp * pp)
                    dims = ParallelDims(dp=dp, cp=cp, tp=tp, ulysses=ulysses, pp=pp)
                    why = None
                    if cp * ulysses > 1 and seq_len // (cp * ulysses) < MIN_TOKENS_PER_CP_RANK:
                        why = (
                            f"{seq_len // (cp * ulysses)} tokens a cp x ulysses rank, under "
                            f"{MIN_TOKENS_PER_CP_RANK}: the exchanges would be all latency"
                        )
                    elif pp > spec.n_layers:
                        why = f"pp {pp} is more stages than the {spec.n_layers} layers"
                    if why:
                        if skipped is not None:
                            skipped.append((_label(dims), why))
                        continue
                    for ep, degree in _ep_options(spec, gpus_per_node, dp, cp, ulysses, tp):
                        yield ParallelDims(
                            dp=dp, cp=cp, tp=tp, ulysses=ulysses, pp=pp, ep=ep, ep_degree=degree
                        )


def _ep_options(spec, gpus_per_node, dp, cp, ulysses, tp):
    """(ep, ep_degree) of a MoE model: none, each run of the axes of more than one rank
    (dp, cp, ulysses, tp, in mesh order); with dp, two counts of inner dp ranks (all of
    dp: ep_degree None) whose EP group divides the experts and holds at most `MAX_EP`
    ranks: the most whose group stays inside a node (its all-to-alls on NVLink) and the
    most of all (the fewest experts a rank). Counts between them, which have neither's
    advantage, are not searched: they would triple a large search's time."""
    yield None, None
    if not spec.num_experts:
        return
    degrees = {"dp": dp, "cp": cp, "ulysses": ulysses, "tp": tp}
    axes = [a for a, n in degrees.items() if n > 1]
    for count in range(1, len(axes) + 1):
        for run in combinations(axes, count):
            ep = run[0] if count == 1 else run
            if "dp" not in run:
                yield ep, None
                continue
            others = math.prod(degrees[a] for a in run if a != "dp")
            inner = [  # (a group over dp spans its inner ranks x cp x ulysses x tp)
                n
                for n in _divisors(dp)[1:]
                if others * n <= min(MAX_EP, spec.num_experts)
                and spec.num_experts % (others * n) == 0
            ]
            local = [n for n in inner if gpus_per_node % (n * cp * ulysses * tp) == 0]
            for n in sorted({max(local, default=0), max(inner, default=0)} - {0}):
                yield ep, None if n == dp else others * n


def _label(dims: ParallelDims) -> str:
    return Estimate("", dims, 0, 0, 0, None, "").layout()


def search(
    model,
    *,
    gpus: int,
    seq_len: int,
    global_batch_tokens: int,
    gpus_per_node: int = 8,
    device="h100",
    dtype=torch.bfloat16,
    checkpointing=None,
    schedules=SCHEDULES,
    micro_batches=(1, 2, 4, 8),
    dp_shardings=("zero3", "zero1"),
    **options,
) -> SearchResult:
    """Every layout of `gpus`, its best choices estimated (see the module doc). `checkpointing`:
    one policy, or None for the first of POLICIES that fits. `dp_shardings`: FSDP2's
    modes tried where a dp rank runs several microbatches (`estimate`'s `dp_sharding`).
    `options` go to `estimate`."""
    spec = model_spec(model)
    if global_batch_tokens % seq_len:
        raise ValueError(
            f"global_batch_tokens ({global_batch_tokens}) is not a multiple of seq_len ({seq_len})"
        )
    sequences = global_batch_tokens // seq_len
    policies = POLICIES if checkpointing is None else (checkpointing,)
    result = SearchResult()
    for dims in layouts(spec, gpus, gpus_per_node, seq_len, result.ruled_out):
        try:
            dims.validate(
                gpus,
                n_heads=spec.n_heads,
                n_kv_heads=check_heads(spec, dims),
                num_experts=spec.num_experts or None,
                seq_len=seq_len,
            )
        except ValueError as e:
            result.ruled_out.append((_label(dims), str(e)))
            continue
        if sequences % dims.dp:
            result.ruled_out.append(
                (_label(dims), f"{sequences} sequences a step do not split over dp {dims.dp}")
            )
            continue
        best, tried, why = None, None, None
        for mb in micro_batches:
            per_dp = sequences // dims.dp
            if per_dp % mb:
                continue
            # held parameters pay off only where a step has several microbatches
            shardings = dp_shardings if dims.dp > 1 and per_dp > mb else dp_shardings[:1]
            for schedule, sharding in product(schedules if dims.pp > 1 else (None,), shardings):
                for policy in policies:
                    try:
                        est = estimate(
                            spec,
                            dims,
                            seq_len=seq_len,
                            micro_batch=mb,
                            microbatches=per_dp // mb,
                            schedule=schedule,
                            dtype=dtype,
                            checkpointing=policy,
                            device=device,
                            gpus_per_node=gpus_per_node,
                            dp_sharding=sharding,
                            **options,
                        )
                    except (ValueError, RuntimeError) as e:
                        why = why or str(e)  # the first schedule's reason
                        break
                    if est.fits:
                        if best is None or est.step_time_s < best.step_time_s:
                            best = est
                        break  # a costlier policy is no faster
                    if tried is None or est.memory["peak"] < tried.memory["peak"]:
                        tried = est
        if best is not None:
            result.ranked.append(best)
        elif tried is not None:
            result.out_of_memory.append(tried)
            result.ruled_out.append((_label(dims), tried.notes[-1]))
        else:
            result.ruled_out.append(
                (
                    _label(dims),
                    why
                    or "no microbatch size divides the "
                    f"{sequences // dims.dp} sequences per dp rank",
                )
            )
    result.ranked.sort(key=lambda e: e.step_time_s)
    return result
