"""`SavedActivations`: the bytes a forward keeps for its backward, as autograd holds them.

    saved = SavedActivations(model.parameters())
    policy = saved.recorded(fp.checkpoint_policy())   # selective checkpointing's cache too
    with saved:
        loss = model(tokens, labels)                  # blocks under checkpoint(context_fn=policy)
    saved.nbytes                                      # distinct storages, parameters left out
    saved.peak                                        # the most held at once (a whole step's)

What is counted: every tensor ``torch.autograd.graph.saved_tensors_hooks`` packs (a
storage once, however many views of it are saved; a DTensor's local shard), and the
outputs a selective-checkpointing context made by `recorded` keeps for the backward's
recompute. Under ``torch.utils.checkpoint`` (non-reentrant) what a checkpointed region
saves inside is not packed by an outer hook: its inputs are, which is what it holds.

`peak` follows what autograd still holds of the packed tensors (selective
checkpointing's cache is not followed): one counts until its graph lets it go, after
that node's backward; so around a pipeline's whole step `peak` is the most its
in-flight microbatches hold at once (`nbytes`, for one forward, would there count a
storage freed and reused as one).

`tests/test_activation_memory.py` and the planner's tests (`tests/test_plan*.py`) hold
the layers' and `fusedpar.plan`'s accounting to these counts.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Packed:
    """What a pack hook hands autograd: the tensor, and a lifetime to follow."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    """Counts the storages a forward saves for its backward (see the module doc)."""

    def __init__(self, parameters=()):
        self._parameters = {_local(p).untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}  # data_ptr -> bytes
        self._contexts: list = []
        self._hooks = None
        self._holders: Counter = Counter()  # data_ptr -> packed tensors autograd holds
        self._held = 0  # bytes of the storages held now
        self.peak = 0

    def recorded(self, context_fn):
        """`context_fn` (``fp.checkpoint_policy()``, say) whose caches are counted."""

        def recording():
            self._contexts.append(context_fn())
            return self._contexts[-1]

        return recording

    def _keep(self, t: torch.Tensor) -> int | None:
        """Counts `t`'s storage; its data_ptr, None for a parameter's."""
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in self._parameters:
            return None
        self.storages[storage.data_ptr()] = storage.nbytes()
        return storage.data_ptr()

    def _pack(self, t: torch.Tensor):
        ptr = self._keep(t)
        if ptr is None:
            return t
        packed = _Packed(t)
        if not self._holders[ptr]:
            self._held += self.storages[ptr]
            self.peak = max(self.peak, self._held)
        self._holders[ptr] += 1
        weakref.finalize(packed, self._release, ptr, self.storages[ptr])
        return packed

    def _release(self, ptr: int, nbytes: int) -> None:
        self._holders[ptr] -= 1
        if not self._holders[ptr]:
            self._held -= nbytes

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for forward_context, _ in self._contexts:  # selective checkpointing's cache
            for outputs in forward_context.storage.values():
                leaves = tree_leaves(list(outputs.values()), is_leaf=lambda x: hasattr(x, "val"))
                for leaf in leaves:
                    value = getattr(leaf, "val", None)
                    if isinstance(value, torch.Tensor):
                        self._keep(value)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
