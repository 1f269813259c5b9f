"""The GEMMs of an op's call, planned once per the op's own key: `GemmSequence`.

`matmul` works out a call's signature (every operand's shape, strides, dtype, device
and alignment, the flags, the fp32 precision, the TMA rule) and looks its plan up: a
dozen attribute reads and a dict lookup a GEMM, several times an op. An op whose GEMMs
follow from its inputs instead keys them all once: its key holds what decides every
GEMM's signature (its inputs' layouts, its flags, the fp32 precision and the TMA rule;
the tensors it allocates between its GEMMs are new, so their layouts follow from the
shapes, and torch's allocators align them to 16 bytes or more). The first call of a key
runs `matmul` for each GEMM and keeps the plans, in order; a later call launches each
GEMM from its kept plan once its pick is settled (`matmul.launch_planned`), else runs
`matmul` (a forced config, a frozen loop, another implementation). The same kernels,
arguments and picks: the same bits. Host time: bench/host_overhead.py.
"""

import torch
from fusedpar.kernels import common, impl
from fusedpar.kernels.matmul import PLANS, launch_planned, matmul
from fusedpar.kernels.matmul_plan import layout, signature  # noqa: F401 (layout: the ops')

_SEQUENCES: dict[tuple, list] = {}
MAX_SEQUENCES = 4096  # a property test's many shapes: start over rather than grow


def state() -> tuple:
    """What an op's key holds of the process's state: the fp32 matmul precision and the
    TMA rule in force (`common.tma_compatible`: tests swap it)."""
    return torch.get_float32_matmul_precision(), common.tma_compatible


class GemmSequence:
    """The GEMMs of one call of an op whose `key` decides every one's signature (see the
    module doc), called in the same order each time as `matmul` is (no agreement, not
    ``tune_only``). `close()` after the last keeps a first call's plans."""

    __slots__ = ("key", "plans", "made", "request", "at")

    def __init__(self, key: tuple):
        self.request = impl.requested()  # (which implementation ran decides the plans)
        self.key = (self.request, key)
        self.plans, self.at = _SEQUENCES.get(self.key), 0
        self.made = [] if self.plans is None else None

    def __call__(self, a, b, *, bias=None, out=None, accumulate=False, out_dtype=None,
                 rope=None, gated=None) -> torch.Tensor:  # fmt: skip
        if self.plans is not None and self.at < len(self.plans):
            plan = self.plans[self.at]
            self.at += 1
            if plan is not None:
                c = launch_planned(plan, self.request, a, b, bias, out, rope, gated)
                if c is not None:
                    return c
        c = matmul(a, b, bias=bias, out=out, accumulate=accumulate, out_dtype=out_dtype,
                   rope=rope, gated=gated)  # fmt: skip
        if self.made is not None:  # its plan, where the kernels ran (torch's: none)
            self.made.append(PLANS.get(signature(a, b, bias, out, accumulate, out_dtype,
                                                 False, rope, None, gated)))  # fmt: skip
        return c

    def close(self) -> None:
        """Keep the plans of a first call's GEMMs for the next call of its key."""
        if self.made is not None:
            if len(_SEQUENCES) >= MAX_SEQUENCES:
                _SEQUENCES.clear()
            _SEQUENCES[self.key] = self.made
