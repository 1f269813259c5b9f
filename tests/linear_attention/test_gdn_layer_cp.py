"""`fp.nn.GatedDeltaNet` under context parallelism on 4 gloo ranks, against the same layer
on one process (float64 both: output, dx and every parameter's gradient): the summaries
over a ring of 4 (zigzag, packed documents across spans), TP 2 x CP 2, and CP 2 x
Ulysses 2 with the heads over Ulysses (OLMo Hybrid's beta up to 2), and the mode chosen
by bytes. The parameters' gradients are reduced by `fp.distribute` over the token axes:
summed in float64 over ranks, so 1e-9 relative."""

import pytest
import torch

import fusedpar as fp
from fusedpar.nn.gated_deltanet import GatedDeltaNet
from tests.linear_attention.layer_helpers import D_MODEL, full, hf_module

SEQ = 32  # 8 zigzag spans of 4 tokens on 4 ranks


def _local(t, groups):
    """(S, B, d) -> this rank's (S / (CP U TP), B, d): the CP (hybrid) shard, then TP's."""
    t = fp.shard_sequence(t, groups["cp"], dim=0, ulysses_group=groups["ulysses"])
    return t.chunk(fp.comm.group_size(groups["tp"]))[fp.comm.group_rank(groups["tp"])]


def _run(layer, x, dy, cu_seqlens):
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad} | {n: full(p.grad) for n, p in layer.named_parameters()}


def _cp(family, axes, mode, documents):
    dims = fp.ParallelDims(**axes)
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    module = hf_module(family, seed=7)
    batch = 1 if documents else 2
    gen = torch.Generator().manual_seed(8)
    x, dy = (torch.randn(SEQ, batch, D_MODEL, generator=gen, dtype=torch.float64) for _ in "xy")
    cu = None
    if documents:  # a document ending on a span boundary, one of a token, one across 3 spans
        cu = torch.tensor([0, 4, 5, 19, SEQ], dtype=torch.int32)
    exact = _run(GatedDeltaNet.from_dense(module, dtype=torch.float64), x, dy, cu)
    placement = dims.placement(mesh, linear_cp_mode=mode)
    layer = GatedDeltaNet.from_dense(module, placement, dtype=torch.float64)
    token_axes = tuple(a for a in ("cp", "ulysses", "tp") if axes.get(a, 1) > 1)
    fp.distribute(layer, mesh, token_axes=token_axes)
    got = _run(layer, _local(x, groups), _local(dy, groups), cu)
    for name, value in got.items():
        ref = _local(exact[name], groups) if name in ("y", "dx") else exact[name]
        torch.testing.assert_close(value, ref, rtol=1e-9, atol=1e-12, msg=name)
    return True


CASES = {
    "ring4-summaries-documents": ("qwen3_5", {"cp": 4}, None, True),
    "tp2-cp2-summaries": ("qwen3_next", {"tp": 2, "cp": 2}, "summaries", False),
    "cp2-ulysses2-heads": ("olmo_hybrid", {"cp": 2, "ulysses": 2}, "ulysses", True),
    # the same mesh, no head exchange: halos and summaries over all four shards
    "cp2-ulysses2-summaries": ("qwen3_5", {"cp": 2, "ulysses": 2}, "summaries", True),
    "cp2-ulysses2-by-bytes": ("qwen3_next", {"cp": 2, "ulysses": 2}, None, False),
}


@pytest.mark.parametrize("name", CASES)
def test_gated_deltanet_under_cp_matches_one_process(world, name):
    assert all(world(4).run(_cp, *CASES[name]))
