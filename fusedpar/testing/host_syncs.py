"""Find host syncs in a hot path on any machine, CPU included.

On a GPU, reading a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``),
an op whose output size depends on the data (``nonzero``, boolean indexing, ...) or a
tensor built on the CPU and copied over stalls the host until the GPU catches up; on a
CPU nothing stalls. `HostSyncs` records these calls wherever they run, so a CPU test
can fail when one appears. Two layers, as neither sees everything alone (torch 2.13):
a ``TorchDispatchMode`` sees the aten ops that sync, in forward, backward and hooks; a
``TorchFunctionMode`` sees what never reaches the dispatcher on a CPU (``.tolist()``,
``.cpu()``, factory calls without ``device=``). A mode is off while it handles a call,
so the dispatch mode runs a custom op's Python body itself with both modes back on.
Only calls from the code under `packages` count (fusedpar's by default), and not CPU
work inside a function marked `fusedpar.kernels.impl.cpu_path`. What is seen and what
is not: docs/testing.md.

    with HostSyncs() as syncs:
        fp.flash_attn(q, k, v).sum().backward()
    assert not syncs.found, syncs.report()
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fusedpar
import fusedpar.kernels
from fusedpar.kernels.impl import CPU_PATHS

_BODIES_UNSEEN_SAID = False  # the warning of `_python_body`, given once

# Python-level calls that never reach the dispatcher on a CPU.
_HOST_COPIES = {"tolist", "numpy", "cpu"}
_FACTORIES = {
    "arange",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "linspace",
    "eye",
}
_FROM_DATA = {"tensor", "as_tensor", "from_numpy"}
# aten ops (overload packets) whose output size depends on the data: the host waits.
_DATA_SIZED = {
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
    "masked_scatter_",
}
# aten ops that read a device value on the host (below autograd, as inside a custom op's
# body, the composite ones arrive whole: item, is_nonzero, allclose).
_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
_HERE = Path(__file__).resolve()
_TORCH = str(Path(torch.__file__).resolve().parent)


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _why_function(func, args, kwargs) -> str | None:
    """Python-level calls the dispatch layer cannot see on a CPU."""
    name = _name(func)
    if name in _HOST_COPIES:
        return f"copies to the host (.{name}())"
    if name == "to" and args and isinstance(args[0], torch.Tensor):
        # (a tensor moved to its own device: no copy, and on a CPU run every device is one)
        targets = (*args[1:], kwargs.get("device"))
        devices = [torch.device(a).type for a in targets if isinstance(a, str | torch.device)]
        if any(device != args[0].device.type for device in devices):
            return "copies between the host and the device (.to)"
    if getattr(func, "__module__", None) not in ("torch", None):
        return None
    if name in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
        return f"torch.{name} of Python data: a host-to-device copy on a GPU run"
    if name in _FACTORIES and "device" not in kwargs:
        return f"torch.{name} without device=: built on the CPU, then copied on a GPU run"
    return None


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _why_aten(func, args, kwargs) -> str | None:
    """aten-level calls that sync (what ``torch.cuda.set_sync_debug_mode`` would catch)."""
    name = func.overloadpacket.__name__
    if name in _READS:
        return f"reads a device value on the host (.item(), bool(), int(): aten.{name})"
    if name in _DATA_SIZED or name == "where" and len(args) == 1:
        return f"aten.{name}: the output size depends on the data"
    repeats_on_device = func._overloadname in ("Tensor", "self_Tensor")
    if name == "repeat_interleave" and repeats_on_device and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if name in _MASK_INDEXED and len(args) > 1 and any(_is_mask(i) for i in args[1] or ()):
        return f"boolean-mask indexing (aten.{name}: a nonzero inside)"
    if name == "lift_fresh" and args[0].dim() > 0:  # (0-dim: also a[i] = scalar on a CPU)
        return "a tensor made from Python data (torch.tensor): a host-to-device copy"
    if name in ("_to_copy", "copy_"):
        devices = {t.device.type for t in args if isinstance(t, torch.Tensor)}
        if kwargs.get("device") is not None:
            devices.add(torch.device(kwargs["device"]).type)
        if "cpu" in devices and len(devices - {"meta"}) > 1:
            return f"aten.{name} between the host and the device"
    return None


def _python_body(func, args):
    """The Python implementation of a ``torch.library.custom_op`` for these arguments'
    device (its kernels by device type, None: any), or None. (torch has no public way to
    it: a torch that moved the private one leaves the bodies unseen, said once.)"""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:
        global _BODIES_UNSEEN_SAID
        if not _BODIES_UNSEEN_SAID:
            _BODIES_UNSEEN_SAID = True
            warnings.warn(
                f"HostSyncs: torch {torch.__version__} has no torch._library."
                f"custom_ops._maybe_get_opdef: custom ops' bodies go unseen "
                f"(only their aten-level calls are checked)",
                stacklevel=2,
            )
        return None
    opdef = _maybe_get_opdef(func) if func.namespace != "aten" else None
    kernels = getattr(opdef, "_backend_fns", None) or {}
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    return kernels.get(device, kernels.get(None))


def _on_host(args) -> bool:
    """No tensor argument off the host (none at all: a factory, on the host there)."""
    return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


def _in_cpu_path(frame) -> bool:
    while frame is not None:
        if frame.f_code in CPU_PATHS:
            return True
        frame = frame.f_back
    return False


class _Functions(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.owner._quiet:
            why = _why_function(func, args, kwargs)
            if why is not None and self.owner._record(why, args):
                self.owner._quiet += 1  # the aten ops of a call recorded here: once
                try:
                    return func(*args, **kwargs)
                finally:
                    self.owner._quiet -= 1
        return func(*args, **kwargs)


class _Dispatches(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.owner._quiet:
            why = _why_aten(func, args, kwargs)
            if why is not None:
                self.owner._record(why, args)
        body = _python_body(func, args)
        if body is None:
            return func(*args, **kwargs)
        with self.owner._functions, self:  # both modes back on inside the op's body
            return body(*args, **kwargs)


class HostSyncs:
    """Records the host syncs made by code under `packages` while active; ``found`` lists
    ``(reason, "file:line")``."""

    def __init__(self, packages: tuple[str, ...] | None = None):
        if packages is None:
            packages = (
                str(Path(fusedpar.__file__).parent),
                str(Path(fusedpar.kernels.__file__).parent),
            )
        self.packages = tuple(str(Path(p).resolve()) for p in packages)
        self.found: list[tuple[str, str]] = []
        self._quiet = 0
        self._functions, self._dispatches = _Functions(self), _Dispatches(self)

    def __enter__(self) -> HostSyncs:
        self._functions.__enter__()
        try:
            self._dispatches.__enter__()
        except BaseException:
            self._functions.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._dispatches.__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    def _caller(self, args) -> str | None:
        """The first frame outside torch and this module, if it is in `packages` (and the
        call is not host work on a CPU path: `fusedpar.kernels.impl.cpu_path`)."""
        frame = sys._getframe(2)
        if _on_host(args) and _in_cpu_path(frame):
            return None
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

    def _record(self, why: str, args) -> bool:
        where = self._caller(args)
        if where is not None:
            self.found.append((why, where))
        return where is not None

    def report(self) -> str:
        return "\n".join(f"{where}: {why}" for why, where in self.found) or "no host sync"
