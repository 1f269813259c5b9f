"""Which schedule a TP GEMM runs (``overlap=``, or ``FUSEDPAR_OVERLAP`` read at the call):
the table is `fusedpar.ops.linear`'s module doc. Inside the ops a schedule is the ring's
chunks per rank: `SERIAL` (0) for one collective and one GEMM, `FUSED` (-1) for the
persistent GEMM of `fusedpar.ops.linear_fused`, `AUTO` (-2) for "auto" over a group.

**"auto"** is measured per shape on a GPU (`measured_chunks`): the first call of a key
(the op's side, the world size, the rows' bucket, the widths, dtypes) times each of
`AUTO_CANDIDATES` (one run to compile and tune, three timed), sums the times over the
group and keeps the fastest, agreed, in the tuner "tp_schedule" (`fusedpar.kernels.
tuning.all_picks` records it with the tiles). Where nothing is timed (CPU ranks, whose
times say nothing of a deployment; ``FUSEDPAR_TUNING=first``; a CUDA-graph capture or a
torch.compile trace before the pick), **the rule** stands in: ``ring`` on gloo (CPU:
1.01-1.36x serial, bench linear's cpu rows), ``serial`` elsewhere (the first H100 run:
the ring lost to serial at 14 of 16 points and won by at most 3%). Every candidate's
result is checked during the measurement against the serial schedule's (one more run,
the transports' landing buffers filled with NaN first: `symmetric.poisoned`): one that
differs by more than a few roundings is never picked, on any rank, and said so once.
``fused`` is not a candidate until a GPU run has passed its tests (bench/NOTES.md).
"""

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton

from fusedpar import symmetric
from fusedpar.comm import tuning_agreement
from fusedpar.kernels.tuning import tuner as kernel_tuner

SERIAL = 0  # the ops' chunks for the serial schedule (one collective, one GEMM)
FUSED = -1  # the ops' chunks for the fused schedule
AUTO = -2  # the ops' chunks for "auto" over a group: measured per shape, else the rule
OVERLAPS = ("auto", "serial", "ring", "fused")
# "fused" joins once a GPU run has passed its tests (bench/NOTES.md): until then it
# runs where asked for only. (Where a group cannot run it, it is never tried.)
AUTO_CANDIDATES = ("serial", "ring")
AUTO_RING_CHUNKS = 1  # the ring's messages per rank and step when "auto" picks it
TIMED_RUNS = 3  # a fixed count: every rank runs the same collectives


@torch.compiler.assume_constant_result
def resolve_overlap(overlap: str | None, pg: dist.ProcessGroup | None) -> str:
    """The schedule ("serial", "ring" or "fused") a call over `pg` runs: `overlap`, or
    where it is None ``FUSEDPAR_OVERLAP`` (read here, at the call), or "auto"; "auto" by
    the rule in the module doc. "fused" where it cannot run (`symmetric.unavailable`:
    not NCCL, or a torch without symmetric memory) raises a ValueError saying why, the
    same on every rank and before any collective. A constant to torch.compile."""
    if overlap is None:
        variable = os.environ.get("FUSEDPAR_OVERLAP", "auto") or "auto"
        name = _known(variable, "FUSEDPAR_OVERLAP must be")
    else:
        name = _known(overlap, "overlap must be")
    if name == "fused":
        reason = symmetric.unavailable(pg) if pg is not None else None
        if reason is not None:
            raise ValueError(
                "overlap='fused' (one persistent GEMM waiting on chunks that symmetric "
                f"memory's copy engine delivers) cannot run here: {reason}; use 'serial' or "
                "'ring'"
            )
        return "fused" if pg is not None else "serial"
    backend = None if pg is None else dist.get_backend(pg)
    return auto_overlap(backend) if name == "auto" else name


def auto_overlap(backend: str | None) -> str:
    """The schedule "auto" runs on a group of `backend` (the module doc's rule)."""
    return "ring" if backend == "gloo" else "serial"


def _known(name: str, must: str) -> str:
    """`name` if it is one of `OVERLAPS`, else a ValueError ("`must` one of ...")."""
    if name not in OVERLAPS:
        raise ValueError(f"{must} one of {', '.join(map(repr, OVERLAPS))}, got {name!r}")
    return name


def check_overlap(overlap: str | None) -> str | None:
    """`overlap` as a layer keeps it (None, or one of `OVERLAPS`): a typo fails when the
    layer is built, not at its first call."""
    return None if overlap is None else _known(overlap, "overlap must be None or")


@torch.compiler.assume_constant_result
def ring_chunks(overlap: str | None, pg, chunks_per_rank: int) -> int:
    """The ops' `chunks`: `chunks_per_rank` for the ring, `SERIAL`, `FUSED`, or `AUTO`
    ("auto" over a group, decided per shape in the op: `measured_chunks`)."""
    schedule = resolve_overlap(overlap, pg)
    if pg is not None and _asked(overlap) == "auto":
        return AUTO
    return {"serial": SERIAL, "fused": FUSED}.get(schedule, chunks_per_rank)


def _asked(overlap: str | None) -> str:
    return overlap or os.environ.get("FUSEDPAR_OVERLAP", "auto") or "auto"


_CHUNKS = {"serial": SERIAL, "ring": AUTO_RING_CHUNKS, "fused": FUSED}


def measures(device: torch.device) -> bool:
    """Whether "auto" times its candidates on `device` (a GPU, unless
    ``FUSEDPAR_TUNING=first``, a capture or a trace) or takes the rule."""
    if device.type != "cuda" or os.environ.get("FUSEDPAR_TUNING") == "first":
        return False
    return not (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling())


def measured_chunks(
    side: str, key: tuple, pg: dist.ProcessGroup, device: torch.device, run: Callable[[int], object]
) -> int:
    """The chunks "auto" runs for a call of the op `side` whose shape is `key`: the pick
    kept for it, or, on its first call where `measures` (every rank of `pg` reaching it
    with the same key, as a collective op's call does), each candidate run once (its
    tiles tuned) and `TIMED_RUNS` times by ``run(chunks)``, the times summed over the
    group and the fastest kept; elsewhere the rule."""
    rule = _CHUNKS[auto_overlap(dist.get_backend(pg))]
    if not measures(device):
        return rule
    tuner = kernel_tuner("tp_schedule")
    agreement = tuning_agreement(pg, device)
    scope = (agreement.name, (side, dist.get_world_size(pg), *key))
    pick = tuner.picks.get(scope)
    if pick is None:
        names = [n for n in AUTO_CANDIDATES if n != "fused" or symmetric.unavailable(pg) is None]
        reference = _tensors(run(SERIAL))
        times = []
        for name in names:
            times.append(_time_runs(lambda c=_CHUNKS[name]: run(c), device))
            with symmetric.poisoned():
                error = _disagreement(_tensors(run(_CHUNKS[name])), reference)
            if error is not None:  # never picked, on any rank (the sum is inf)
                times[-1] = float("inf")
                symmetric.say_once(
                    f"'auto' left {name!r} out for {side}: its result "
                    f"differed from the serial schedule's by {error:.3g} "
                    "(relative)"
                )
        times = agreement.sum_times(times)
        best = min(range(len(times)), key=times.__getitem__)
        pick = tuner.picks[scope] = triton.Config({"overlap": names[best]})
        tuner.timings[scope], tuner.tuned = times, tuner.tuned + 1
        if os.environ.get("FUSEDPAR_PRINT_TUNING") == "1":
            print(
                f"fusedpar tuning: tp_schedule {scope} -> {names[best]} "
                f"({', '.join(f'{t:.4f}' for t in times)} ms summed over the group)"
            )
    return _CHUNKS[pick.kwargs["overlap"]]


def _tensors(result) -> list[torch.Tensor]:
    """The tensors of an op's result: a tensor, or ([outputs], gathered)."""
    if isinstance(result, torch.Tensor):
        return [result]
    outs, gathered = result
    return [*outs, gathered]


def _disagreement(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float | None:
    """The relative error (to the largest value) of `got` against the serial schedule's
    `reference` where it is more than the schedules' orders of summation explain (8
    roundings of the dtype, at least 1e-4: 0.06 in bf16, 0.008 in fp16), else None. A
    chunk read before it landed (NaN under `symmetric.poisoned`) is off by far more."""
    worst = 0.0
    for g, r in zip(got, reference, strict=True):
        if r.numel() == 0:
            continue
        scale = r.double().abs().max().item() or 1.0
        diff = (g.double() - r.double()).abs().nan_to_num(float("inf"))
        worst = max(worst, diff.max().item() / scale)
    bound = max(8 * torch.finfo(reference[0].dtype).eps, 1e-4)
    return worst if not worst <= bound else None


def _time_runs(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of `TIMED_RUNS` calls after one untimed (a fixed count, unlike
    ``do_bench``: each call is a collective every rank must make as often)."""
    fn()
    times = []
    for _ in range(TIMED_RUNS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
