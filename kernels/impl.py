"""Which implementation computes an op: fusedpar's Triton kernels or PyTorch's own.

Every launcher in `fusedpar.kernels` has, beside its Triton kernel, a torch
implementation of its whole contract: never a different answer, only a different speed.

| request    | on CUDA                                                         | on CPU      |
| ---------- | --------------------------------------------------------------- | ----------- |
| ``auto``   | the tuner times the capable candidates per key, Triton's tiles  | torch       |
|            | and torch, keeps the fastest (agreed, frozen in ring/TP loops)  |             |
| ``triton`` | Triton's tiles only                                             | interpreter |
| ``torch``  | torch only                                                      | torch       |

The request: `implementation` (a context manager) or else ``FUSEDPAR_IMPL``, read when
a launcher runs, never at import; ``auto`` by default. A launcher asks `runs_torch`, and
offers `TORCH` (a `Torch`) to the tuner beside its tiles. float64 runs torch's
implementation only, in float64 throughout (`fusedpar.kernels.common.accumulator`):
Triton's kernels take `KERNEL_DTYPES`, and ``triton`` with float64 is a TypeError
(`refuse_float64`), never a silent switch. Why, and Triton's interpreter on a CPU:
docs/architecture.md, "Two implementations of every op".
"""

import contextlib
import contextvars
import os
from dataclasses import dataclass, field

import torch

CHOICES = ("auto", "triton", "torch")
_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fusedpar_implementation", default=None
)


def _checked(name, where: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


# The requests active in any thread, innermost last: what a thread that never entered
# `implementation` sees. Autograd runs a CUDA backward on threads of its own, which do
# not inherit the caller's context variables: ``with fp.implementation("triton"):
# loss.backward()`` must still reach the backward's launchers.
_ACTIVE: list[tuple[object, str]] = []


def requested() -> str:
    """The implementation asked for here: this context's `implementation`, else the
    innermost one active in any thread, else ``FUSEDPAR_IMPL``'s, else ``auto``."""
    name = _REQUEST.get()
    if name is not None:
        return name
    if _ACTIVE:
        return _ACTIVE[-1][1]
    return _checked(os.environ.get("FUSEDPAR_IMPL", "auto") or "auto", "FUSEDPAR_IMPL")


@contextlib.contextmanager
def implementation(name: str):
    """Inside, fusedpar's ops run `name`'s implementation: ``"auto"``, ``"triton"`` or
    ``"torch"`` (see the module's table), the backward of what runs inside too (on the
    autograd engine's threads). `fusedpar.testing.World.run` carries the request to its
    ranks."""
    entry = (object(), _checked(name, "implementation"))
    token = _REQUEST.set(entry[1])
    _ACTIVE.append(entry)
    try:
        yield
    finally:
        _REQUEST.reset(token)
        _ACTIVE.remove(entry)


# Code that runs only on a CPU, where reading a tensor on the host reads host memory: a
# path the torch implementation takes on a CPU (where ``auto`` runs it, never under
# ``auto`` on a GPU), a check skipped on GPUs. `fusedpar.testing.HostSyncs` does not count
# what such code does with CPU tensors (the same read of a GPU tensor, when the torch
# implementation is forced there, still counts).
CPU_PATHS: set = set()


def cpu_path(fn):
    """Mark `fn` as one of the `CPU_PATHS` (unchanged, no cost at run time)."""
    CPU_PATHS.add(fn.__code__)
    return fn


# What Triton's kernels take; float64 runs on torch's implementation only.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refuse_float64(what: str) -> None:
    """The TypeError for float64 under an explicit ``triton`` request; `what` names the
    tensor ("q", "x (4, 8)")."""
    raise TypeError(
        f"{what} is float64: fusedpar's Triton kernels take float16, bfloat16 and float32, "
        f"and FUSEDPAR_IMPL=triton (or fusedpar.implementation('triton')) asks for them. "
        f"torch's implementation runs float64 (computed in float64 throughout): use "
        f"'auto' (the default) or 'torch' for it"
    )


def runs_torch(t: torch.Tensor, name: str | None = None) -> bool:
    """Whether a launch on `t` (its device and dtype) runs the torch implementation
    outright (no tuning): float64 always (a TypeError under ``triton``,
    `refuse_float64`), else asked for, or ``auto`` off CUDA. `name`: `requested()`, where
    the caller has read it already."""
    name = requested() if name is None else name
    if t.dtype == torch.float64:
        if name == "triton":
            refuse_float64(f"a tensor {tuple(t.shape)}")
        return True
    return name == "torch" or (name == "auto" and t.device.type != "cuda")


def tunes_torch() -> bool:
    """Whether a CUDA launch's tuner also times the torch implementation (``auto``)."""
    return requested() == "auto"


def summary(device_type: str) -> str:
    """What runs fusedpar's ops on `device_type`, in words (for a program's first line)."""
    name = requested()
    if name == "torch" or (name == "auto" and device_type != "cuda"):
        return f"torch ops (FUSEDPAR_IMPL={name})"
    if name == "triton":
        where = "compiled" if device_type == "cuda" else "in Triton's interpreter"
        return f"Triton kernels, {where} (FUSEDPAR_IMPL=triton)"
    return "Triton kernels or torch per shape, timed (FUSEDPAR_IMPL=auto)"


@dataclass(frozen=True)
class Torch:
    """A tuner candidate that runs the torch implementation instead of a Triton tile:
    the tuner holds it beside the tiles, times it the same way and records it as a pick.
    ``kwargs`` are empty, so code that reads a config's block sizes sees none."""

    name: str = "torch"
    kwargs: dict = field(default_factory=dict, compare=False)

    def all_kwargs(self) -> dict:
        return {}


TORCH = Torch()
