"""No host syncs in the hot paths: flash attention, the TP linears, the attention layer.

`HostSyncs` records, on CPU too, the calls that would stall the host on a GPU (see
`fusedpar.testing.host_syncs`). Each path runs once to warm up (tuning a new key syncs
once, by design) and is then checked forward and backward.
"""

import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing.host_syncs import HostSyncs
from fusedpar.testing.strategies import randn


def _syncs_of(step):
    step()  # warm-up: tuning and first-use caches
    with HostSyncs() as syncs:
        step()
    return syncs.report() if syncs.found else None


def test_the_detector_sees_each_kind_of_sync():
    from pathlib import Path

    x = torch.arange(6.0, device="cpu")
    with HostSyncs(packages=(str(Path(__file__).parent),)) as syncs:
        x.sum().item()
        bool(x[0] > 0)
        x[x > 2]
        torch.bincount(x.long())
        torch.arange(3)
        repeats = torch.ones(6, dtype=torch.long, device=x.device)
        x.repeat_interleave(repeats)
        x.repeat_interleave(repeats, output_size=6)  # no sync
        torch.zeros(3, device=x.device)  # no sync
    reasons = [why for why, _ in syncs.found]
    assert len(reasons) == 6, syncs.report()
    for word in ("item", "__bool__", "boolean-mask", "bincount", "arange", "repeat_interleave"):
        assert any(word in r for r in reasons), (word, syncs.report())


def test_flash_attention_has_no_host_sync():
    q = randn((2, 19, 4, 16), torch.float32, 0).requires_grad_()
    k, v = (randn((2, 23, 2, 16), torch.float32, i).requires_grad_() for i in (1, 2))

    def step():
        fp.flash_attn(q, k, v, causal=True).sum().backward()

    assert _syncs_of(step) is None, _syncs_of(step)


def test_attention_layer_has_no_host_sync():
    torch.manual_seed(0)
    layer = fp.nn.ParallelAttention(32, 4, 2)
    x = torch.randn(12, 2, 32, requires_grad=True)

    def step():
        layer(x).sum().backward()

    assert _syncs_of(step) is None, _syncs_of(step)


def _tp_linears():
    torch.manual_seed(0)
    group = dist.group.WORLD
    mlp = fp.nn.ParallelSwiGLU(16, 24, group)
    column = fp.nn.ColumnParallelLinear(16, 8, group)
    row = fp.nn.RowParallelLinear(8, 16, group)
    x = torch.randn(6, 16, requires_grad=True)

    def step():
        (mlp(x).sum() + row(column(x)).sum()).backward()

    return _syncs_of(step)


def test_tp_linears_have_no_host_sync(world):
    assert world(2).run(_tp_linears) == [None, None]
