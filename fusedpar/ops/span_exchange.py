"""What crosses the ranks holding a sequence's spans (`fusedpar.ops.spans`): the
recurrent ops' all-gathers and sums and the conv's point-to-point halo, over one group
(`Exchange`: a ring, zigzag or contiguous) or over the two axes of the hybrid layout
(`MeshExchange`: a ring and a Ulysses group, rank r U + u). A benchmark stands in for
one to time a rank's work alone."""

import torch
import torch.distributed as dist
from torch import Tensor

from fusedpar.comm import (
    all_gather_async,
    check_same_across_ranks,
    group_by_name,
    group_name,
    group_rank,
    group_size,
    reduce_from_region,
    resolve_group,
)
from fusedpar.ops.spans import Spans


class Exchange:
    """Over `group`: its ranks hold the spans of `spans(layout, local_len)`."""

    ulysses = 1  # `Spans`' Ulysses degree

    def __init__(self, group):
        self.group = resolve_group(group)
        self.rank, self.size = group_rank(self.group), group_size(self.group)

    def spans(self, layout: str, local_len: int) -> Spans:
        return Spans(self.rank, self.size, layout, local_len, self.ulysses)

    def gather(self, x: Tensor) -> Tensor:
        """(R n, ...): every rank's `x` (n, ...), in `Spans`' rank order (no autograd)."""
        return all_gather_async(x.contiguous(), self.group).wait()

    def sum(self, x: Tensor) -> Tensor:
        """`x` summed over the ranks, in place (no autograd)."""
        dist.all_reduce(x, group=self.group)
        return x

    def reduce(self, x: Tensor) -> Tensor:
        """`x` summed over the ranks; its backward the identity (a replicated value's)."""
        return reduce_from_region(x, self.group)

    def check_same(self, values, what: str, device) -> None:
        check_same_across_ranks(self.group, values, what, device)

    def peer(self, rank: int) -> tuple[int, object]:
        """(global rank, group) of `rank` for a point-to-point op."""
        return dist.get_global_rank(self.group, rank), self.group

    @property
    def names(self) -> tuple[str, str]:
        """(group, Ulysses group) as they cross a custom op's boundary (`exchange_of`)."""
        return group_name(self.group), ""


_GLOBAL_RANKS: dict[tuple[str, str], list[int]] = {}  # (ring, Ulysses) -> r U + u's rank


class MeshExchange(Exchange):
    """Over a ring group and a Ulysses group, two axes of a mesh: rank r U + u (ring rank
    r, Ulysses rank u); gathers and sums over the Ulysses axis, then the ring."""

    def __init__(self, ring, ulysses):
        self.ring, self.ulysses_group = resolve_group(ring), resolve_group(ulysses)
        self.size, self.ulysses = group_size(self.ring), group_size(self.ulysses_group)
        self.rank = group_rank(self.ring) * self.ulysses + group_rank(self.ulysses_group)

    def gather(self, x: Tensor) -> Tensor:
        inner = all_gather_async(x.contiguous(), self.ulysses_group).wait()
        return all_gather_async(inner, self.ring).wait()

    def sum(self, x: Tensor) -> Tensor:
        for group in (self.ulysses_group, self.ring):
            if group is not None:
                dist.all_reduce(x, group=group)
        return x

    def reduce(self, x: Tensor) -> Tensor:
        return reduce_from_region(reduce_from_region(x, self.ulysses_group), self.ring)

    def check_same(self, values, what: str, device) -> None:
        for group in (self.ulysses_group, self.ring):
            check_same_across_ranks(group, values, what, device)

    @property
    def names(self) -> tuple[str, str]:
        return group_name(self.ring), group_name(self.ulysses_group)

    def peer(self, rank: int) -> tuple[int, object]:
        """Global ranks over the default group: every rank's, gathered once a mesh."""
        key = (group_name(self.ring), group_name(self.ulysses_group))
        if key not in _GLOBAL_RANKS:
            mine = torch.tensor([dist.get_rank()])
            _GLOBAL_RANKS[key] = self.gather(mine).tolist()
        return _GLOBAL_RANKS[key][rank], None


def exchange_of(group: str, ulysses: str) -> Exchange:
    """The exchange of `Exchange.names`: over `group`, or the mesh of both."""
    if ulysses:
        return MeshExchange(group_by_name(group), group_by_name(ulysses))
    return Exchange(group_by_name(group))
