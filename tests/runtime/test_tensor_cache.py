"""`fusedpar.kernels.common.TensorCache`, the one cache of what a call read off a few
tensors (attention's packed masks, the gated delta rule's documents' check): an entry
serves the very tensors it was made for, unwritten since, under the same key; and the
gated delta rule on the kernels' path reads a packed batch's cu_seqlens once, forward
and backward, again only for a tensor written in place or a new one. (Attention's:
tests/attention/test_attention_masks.py.)"""

import gc

import torch
import torch.nn.functional as F
from fusedpar.kernels.common import TensorCache
from fusedpar.kernels.linear_attention import launch

import fusedpar as fp
from fusedpar.testing.strategies import randn


def test_an_entry_serves_its_own_unwritten_tensors_under_its_key():
    cache = TensorCache(2)
    a, b = torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7])
    cache.put((a,), (7,), "a at 7")
    assert cache.get((a,), (7,)) == "a at 7"
    assert cache.get((b,), (7,)) is None  # equal values, another tensor
    assert cache.get((a,), (8,)) is None  # another key
    a.add_(0)  # written in place: its version moved
    assert cache.get((a,), (7,)) is None
    cache.put((a, b), (), "pair")
    cache.put((b,), (), "b")
    cache.put((a,), (1,), "a at 1")  # past size 2: the oldest ("pair") goes
    assert cache.get((a, b)) is None and cache.get((b,)) == "b"
    c = torch.tensor([1])
    cache.put((c,), (), "c")
    stale_id = id(c)
    del c
    gc.collect()
    d = torch.tensor([1])  # may reuse the dead tensor's id: never its entry
    assert id(d) != stale_id or cache.get((d,)) is None


def test_the_gated_delta_rules_documents_are_checked_once(triton_kernels, monkeypatch):
    calls = []
    check = launch.check_cu_seqlens

    def counted(*args, **kwargs):  # the values' reads (the shapes' are free)
        calls.extend([1] if kwargs.get("values", True) else [])
        return check(*args, **kwargs)

    monkeypatch.setattr(launch, "check_cu_seqlens", counted)
    monkeypatch.setattr(launch, "_CHECKED_DOCUMENTS", TensorCache(64))
    T, H, K = 20, 1, 16
    q, k, v = (randn((1, T, H, K), torch.float32, seed) for seed in (1, 2, 3))
    k = F.normalize(k, dim=-1)
    g = -torch.rand(1, T, H, generator=torch.Generator().manual_seed(4))
    beta = torch.rand(1, T, H, generator=torch.Generator().manual_seed(5))
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]

    def run(cu):
        o, _ = fp.gated_delta_rule(*leaves, cu_seqlens=cu)
        grads = torch.autograd.grad(o.sum(), leaves)
        return o.detach(), grads

    cu = torch.tensor([0, 7, T], dtype=torch.int32)
    first = run(cu)
    assert len(calls) == 1  # the forward's; the backward took it
    again = run(cu)
    assert len(calls) == 1 and torch.equal(first[0], again[0])
    cu.copy_(torch.tensor([0, 12, T], dtype=torch.int32))  # written in place: read anew
    moved = run(cu)
    assert len(calls) == 2 and not torch.equal(moved[0], first[0])
    fresh = run(torch.tensor([0, 12, T], dtype=torch.int32))  # a new tensor: read anew
    assert len(calls) == 3 and torch.equal(fresh[0], moved[0])
