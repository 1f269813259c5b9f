"""Count the collectives a piece of code runs, per kind and group size, on any machine.

    with Collectives() as seen:
        step()
    seen.counts  # {("all_reduce", 4): 7, ("send", 2): 16, ...}
    seen.bytes  # the same keys: the bytes of the tensors each kind was given
    seen.calls  # each in order: (kind, the group's ranks, bytes)

A ``TorchDispatchMode`` sees each ``torch.distributed`` collective as the c10d op it
dispatches (eager ``dist.*`` calls, DTensor's functional collectives, FSDP's), inside
custom ops' bodies too (run with the mode on, as `HostSyncs` does). The kind is the op's
name without c10d's decorations (``allreduce_`` -> ``all_reduce``; ``_allgather_base_``
-> ``all_gather``), the size that of the group it runs on. ``wait_tensor`` and the
autograd wrappers of functional collectives are not collectives and are not counted.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fusedpar.testing.host_syncs import _python_body

_KINDS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",  # gloo's reduce_scatter_tensor
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "gather": "gather",
    "scatter": "scatter",
    "reduce": "reduce",
}


def _tensors(args):
    """The tensors among a collective's arguments (c10d's take lists of them)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _group(args) -> dist.ProcessGroup | None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(a)
            except (KeyError, ValueError, RuntimeError):
                continue
        if isinstance(a, dist.ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):  # c10d's ops carry the group boxed
            try:
                return dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
    return None


class Collectives(TorchDispatchMode):
    """Counts ``(kind, group size)`` of the collectives run while active (``counts``,
    ``bytes``), and lists each (``calls``: its kind, group's ranks and bytes)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _KINDS.get(func.overloadpacket.__name__.strip("_"))
            if kind is not None:
                group = _group((*args, *kwargs.values()))
                key = kind, None if group is None else group.size()
                nbytes = sum(t.nbytes for t in _tensors((*args, *kwargs.values())))
                self.counts[key] += 1
                self.bytes[key] += nbytes
                ranks = () if group is None else tuple(dist.get_process_group_ranks(group))
                self.calls.append((kind, ranks, nbytes))
        body = _python_body(func, args)
        if body is None:
            return func(*args, **kwargs)
        with self:  # inside a custom op's body too
            return body(*args, **kwargs)

    def of(self, kind: str) -> int:
        """How many collectives of `kind`, over every group size."""
        return sum(n for (k, _), n in self.counts.items() if k == kind)
