"""`SavedActivations`: the bytes a forward keeps for its backward, as autograd holds them.

    saved = SavedActivations(model.parameters())
    policy = saved.recorded(fp.checkpoint_policy())   # selective checkpointing's cache too
    with saved:
        loss = model(tokens, labels)                  # blocks under checkpoint(context_fn=policy)
    saved.nbytes                                      # distinct storages, parameters left out
    saved.peak                                        # the most held at once (a whole step's)

Counted: every tensor ``saved_tensors_hooks`` packs (a storage once, however many views;
a DTensor's local shard) and the outputs a context made by `recorded` keeps for the
recompute; inside a non-reentrant ``checkpoint`` region its inputs are what it holds.
`peak` follows what is still held (a packed tensor until its node's backward, a cached
output until the recompute takes it), so around a pipeline's step it is the most its
in-flight microbatches hold at once. The cache is read through torch's
selective-checkpointing contexts' ``storage`` (torch 2.13): another layout raises.
tests/plan/test_activation_memory.py and tests/plan/test_plan*.py hold the layers' and
`fusedpar.plan`'s accounting to these counts.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict

import torch
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Packed:
    """What a pack hook hands autograd: the tensor, and a lifetime to follow."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Cache(dict):
    """One op's entries in a selective-checkpointing cache ({call index: entry}): an
    entry's tensors are held from when it is stored to when the recompute replaces it
    (with a marker)."""

    def __init__(self, owner: SavedActivations):
        super().__init__()
        self.owner = owner

    def __setitem__(self, index, entry):
        if index in self:
            self.owner._drop_entry(self[index])
        self.owner._hold_entry(entry)
        super().__setitem__(index, entry)


def _tensors_of(entry) -> list[torch.Tensor]:
    leaves = tree_leaves(entry, is_leaf=lambda x: hasattr(x, "val"))
    return [x.val for x in leaves if isinstance(getattr(x, "val", None), torch.Tensor)]


class SavedActivations:
    """Counts the storages a forward saves for its backward (see the module doc)."""

    def __init__(self, parameters=()):
        self._parameters = {_local(p).untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}  # data_ptr -> bytes
        self._hooks = None
        self._holders: Counter = Counter()  # data_ptr -> saved tensors holding it
        self._held = 0  # bytes of the storages held now
        self.peak = 0

    def recorded(self, context_fn):
        """`context_fn` (``fp.checkpoint_policy()``, say) whose caches are counted."""

        def recording():
            forward, recompute = context_fn()
            storage = getattr(forward, "storage", None)
            if not (
                isinstance(storage, defaultdict)
                and storage.default_factory is dict
                and getattr(recompute, "storage", None) is storage
            ):
                raise RuntimeError(
                    "SavedActivations.recorded: this torch's selective "
                    "checkpointing keeps its cache otherwise than torch 2.13's "
                    "{op: {call index: entry}}"
                )
            forward.storage = recompute.storage = defaultdict(lambda: _Cache(self))
            return forward, recompute

        return recording

    def _keep(self, t: torch.Tensor) -> int | None:
        """Counts `t`'s storage; its data_ptr, None for a parameter's."""
        storage = _local(t).untyped_storage()
        if storage.data_ptr() in self._parameters:
            return None
        self.storages[storage.data_ptr()] = storage.nbytes()
        return storage.data_ptr()

    def _hold(self, t: torch.Tensor) -> int | None:
        ptr = self._keep(t)
        if ptr is not None:
            if not self._holders[ptr]:
                self._held += self.storages[ptr]
                self.peak = max(self.peak, self._held)
            self._holders[ptr] += 1
        return ptr

    def _release(self, ptr: int, nbytes: int) -> None:
        self._holders[ptr] -= 1
        if not self._holders[ptr]:
            self._held -= nbytes

    def _hold_entry(self, entry) -> None:
        for t in _tensors_of(entry):
            self._hold(t)

    def _drop_entry(self, entry) -> None:
        for t in _tensors_of(entry):
            ptr = _local(t).untyped_storage().data_ptr()
            if ptr not in self._parameters:
                self._release(ptr, self.storages[ptr])

    def _pack(self, t: torch.Tensor):
        ptr = self._hold(t)
        if ptr is None:
            return t
        packed = _Packed(t)
        weakref.finalize(packed, self._release, ptr, self.storages[ptr])
        return packed

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
