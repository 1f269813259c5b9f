"""The MoE dispatch's metadata at EP 4 on 4 gloo ranks (#57: EP 16-64 must not grow it):
per layer, one all-to-all of the counts forward (W x E/W int64), the rows out and back,
their reverse backward, and one copy to the host (the variable splits), at 4 experts as
at 32. docs/expert_parallel.md argues it for EP 64."""

import warnings

import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing import Collectives, HostSyncs

D = 8


def _phases(num_experts: int):
    """A layer's second call: its forward's and backward's collectives (counts by kind)
    and its copies to the host."""
    torch.manual_seed(0)
    warnings.simplefilter("ignore")  # (no fp.distribute: only the collectives count here)
    layer = fp.nn.MoE(D, 6, num_experts, 2, dist.group.WORLD).double()
    x = torch.randn(5 + dist.get_rank(), D, dtype=torch.float64, requires_grad=True)
    y, aux = layer(x)  # the first call's checks over the group, once
    (y.sum() + aux).backward()
    with Collectives() as forward, HostSyncs() as syncs:
        y, aux = layer(x)
    with Collectives() as backward:
        (y.sum() + aux).backward()
    copies = [what for what, _ in syncs.found if what.endswith("(.cpu())")]
    return dict(forward.counts), dict(backward.counts), len(copies)


def test_the_metadata_exchange_does_not_grow_with_the_experts(world):
    few, many = (world(4).run(_phases, E)[0] for E in (4, 32))
    for forward, backward, _ in (few, many):
        assert forward == {("all_to_all", 4): 3}  # the counts, the rows out, the rows back
        assert backward == {("all_to_all", 4): 2}  # the rows' gradients, back and out
    # one copy of the splits to the host a layer (read again there: no device sync)
    assert few[2] == many[2] == 1
