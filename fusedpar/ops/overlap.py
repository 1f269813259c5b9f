"""Which schedule a TP GEMM runs (``overlap=``, or ``FUSEDPAR_OVERLAP`` read at the call):
the table is `fusedpar.ops.linear`'s module doc. Inside the ops a schedule is the ring's
chunks per rank: `SERIAL` (0) for one collective and one GEMM, `FUSED` (-1) for the
persistent GEMM of `fusedpar.ops.linear_fused`.

``auto`` is a rule for now: ``ring`` on gloo (CPU: 1.01-1.36x serial, bench linear's
cpu rows), ``serial`` elsewhere (the first H100 run: the ring lost to serial at 14 of 16
points and won by at most 3%). ``fused`` has not yet run on a GPU, so ``auto`` does not
pick it until a GPU run has measured it (bench/NOTES.md).
"""

import os

import torch
import torch.distributed as dist

from fusedpar import symmetric

SERIAL = 0  # the ops' chunks for the serial schedule (one collective, one GEMM)
FUSED = -1  # the ops' chunks for the fused schedule
OVERLAPS = ("auto", "serial", "ring", "fused")


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
            )  # fmt: skip
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


def ring_chunks(overlap: str | None, pg, chunks_per_rank: int) -> int:
    """The ops' `chunks`: `chunks_per_rank` for the ring, `SERIAL`, or `FUSED`."""
    schedule = resolve_overlap(overlap, pg)
    return {"serial": SERIAL, "fused": FUSED}.get(schedule, chunks_per_rank)
