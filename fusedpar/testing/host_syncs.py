"""Find host syncs in a hot path on any machine, CPU included.

On a GPU, reading a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``),
an op whose output size depends on the data (``nonzero``, boolean indexing,
``bincount``, ``unique``, ``repeat_interleave`` without ``output_size``) or a tensor built
on the CPU and copied over stalls the host until the GPU catches up: the CPU can no longer
run ahead, CUDA graphs and ``fullgraph`` compiles break. On a CPU nothing stalls, so the
same code looks fine. `HostSyncs` records these calls wherever they run, through a
``TorchFunctionMode``, so a CPU test can fail when one appears.

Only calls made from the code under `packages` (fusedpar's by default) count: a user's own
``.item()`` or the test's is not ours. Factory calls (``torch.arange``, ``torch.tensor``,
...) without a ``device=`` count too: on a GPU run they build on the CPU and copy.

    with HostSyncs() as syncs:
        fp.flash_attn(q, k, v).sum().backward()
    assert not syncs.found, syncs.report()
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that read device values on the host.
_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
# Ops whose output size depends on the data: the host waits to learn it.
_DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
               "bincount"}  # fmt: skip
_FACTORIES = {"arange", "tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand",
              "randn", "randint", "linspace", "eye"}  # fmt: skip
_HERE = Path(__file__).resolve()
_TORCH = str(Path(torch.__file__).resolve().parent)


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _why(func, args, kwargs) -> str | None:
    name = _name(func)
    if name in _READS:
        return f"reads a device value on the host ({name})"
    if name in _DATA_SIZED:
        return f"{name}: the output size depends on the data"
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    sized = kwargs.get("output_size") is not None
    if name == "repeat_interleave" and isinstance(repeats, torch.Tensor) and not sized:
        return "repeat_interleave without output_size"
    if name == "where" and len(args) + len(kwargs) == 1:
        return "torch.where(cond): the output size depends on the data"
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            return "boolean-mask indexing (a nonzero inside)"
    if name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device"))):
        return "copies to the host (.to('cpu'))"
    if name in _FACTORIES and "device" not in kwargs and func.__module__ in ("torch", None):
        return f"torch.{name} without device=: built on the CPU, then copied on a GPU run"
    return None


class HostSyncs(TorchFunctionMode):
    """Records the host syncs made by code under `packages` while active; ``found`` lists
    ``(reason, "file:line")``."""

    def __init__(self, packages: tuple[str, ...] | None = None):
        super().__init__()
        if packages is None:
            import fusedpar
            import fusedpar.kernels

            packages = (str(Path(fusedpar.__file__).parent),
                        str(Path(fusedpar.kernels.__file__).parent))  # fmt: skip
        self.packages = tuple(str(Path(p).resolve()) for p in packages)
        self.found: list[tuple[str, str]] = []

    def _caller(self) -> str | None:
        """The first frame outside torch and this module, if it is in `packages`."""
        frame = sys._getframe(2)
        while frame is not None:
            file = str(Path(frame.f_code.co_filename).resolve())
            if file != str(_HERE) and not file.startswith(_TORCH):
                break
            frame = frame.f_back
        if frame is None:
            return None
        file = str(Path(frame.f_code.co_filename).resolve())
        testing = str(_HERE.parent)
        if file.startswith(self.packages) and not file.startswith(testing):
            return f"{file}:{frame.f_lineno}"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None:
            where = self._caller()
            if where is not None:
                self.found.append((why, where))
        return func(*args, **kwargs)

    def report(self) -> str:
        return "\n".join(f"{where}: {why}" for why, where in self.found) or "no host sync"
