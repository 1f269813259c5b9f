"""`Placement`: where a layer runs, the parallel half of its construction (its spec, the
model half: `fusedpar.nn.specs`). Frozen, validated when made:

| field               | default  | read by                                               |
| ------------------- | -------- | ----------------------------------------------------- |
| `tp_group`          | None     | attention, MLA, GDN (heads), SwiGLU (hidden)          |
| `cp_group`          | None     | attention, MLA: the ring; GDN: its span summaries     |
| `ulysses_group`     | None     | attention, MLA, GDN: the head all-to-all              |
| `ep_group`          | None     | `MoE`: the experts                                    |
| `cp_mode`           | None     | attention, MLA ("ring", "ulysses", "hybrid")          |
| `cp_layout`         | "zigzag" | attention, MLA, GDN: the sequence's shards over cp    |
| `linear_cp_mode`    | None     | GDN: "summaries", "ulysses" (None: by bytes a call)   |
| `sequence_parallel` | True     | attention, MLA, `GatedDeltaNet`, `ParallelSwiGLU`     |
| `chunks_per_rank`   | 1        | `ParallelSwiGLU`'s ring schedule                      |
| `overlap`           | None     | the TP projections' schedule (`fusedpar.ops.linear`)  |
| `reduce_dtype`      | None     | the dtype their partial sums travel in (None: fp32)   |

A group is a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None (one rank). ``cp_mode`` left
out is read off the groups (`check_cp_mode`); a placement holds the mode it runs (with
``dataclasses.replace`` and other groups pass ``cp_mode=None``). One serves every layer.
"""

from dataclasses import dataclass
from typing import Any

import torch

from fusedpar import comm
from fusedpar.ops.linear import DEFAULT_CHUNKS_PER_RANK, check_reduce_dtype
from fusedpar.ops.overlap import check_overlap

CP_MODES = ("ring", "ulysses", "hybrid")


def check_cp_mode(cp_mode, cp_group, ulysses_group) -> str:
    """`cp_mode` given or read off the groups (see `fusedpar.nn.attention`'s module
    doc); ValueError when the groups do not fit it."""
    ring, ulysses = comm.group_size(cp_group), comm.group_size(ulysses_group)
    inferred = "hybrid" if ring > 1 and ulysses > 1 else "ulysses" if ulysses > 1 else "ring"
    if cp_mode is None:
        return inferred
    if cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode must be one of {CP_MODES}, got {cp_mode!r}")
    if cp_mode == "ring" and ulysses > 1:
        raise ValueError(
            f"cp_mode='ring' with a ulysses_group of {ulysses} ranks: pass "
            f"cp_mode='hybrid' (or leave it out)"
        )
    if cp_mode == "ulysses" and ring > 1:
        raise ValueError(
            f"cp_mode='ulysses' runs over ulysses_group, but cp_group (the ring) "
            f"has {ring} ranks: pass the all-to-all group as ulysses_group, and "
            f"cp_mode='hybrid' to keep a ring as well"
        )
    return cp_mode


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The groups a layer runs over and how it talks over them (see the module doc)."""

    tp_group: Any = None
    cp_group: Any = None
    ulysses_group: Any = None
    ep_group: Any = None
    cp_mode: str | None = None
    cp_layout: str = "zigzag"
    linear_cp_mode: str | None = None
    sequence_parallel: bool = True
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK
    overlap: str | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        # the TP projections' schedule and the dtype their partial sums travel in
        check_overlap(self.overlap)
        check_reduce_dtype(self.reduce_dtype)
        mode = check_cp_mode(self.cp_mode, self.cp_group, self.ulysses_group)
        object.__setattr__(self, "cp_mode", mode)
        if self.linear_cp_mode not in (None, "summaries", "ulysses"):
            raise ValueError(
                f"linear_cp_mode must be None, 'summaries' or 'ulysses', got "
                f"{self.linear_cp_mode!r}"
            )
