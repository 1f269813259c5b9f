"""`MoE(aux_loss="sequence")`: DeepSeek-V3's sequence-wise balance loss (report eq.
17-20) against a float64 plain-PyTorch loop over sequences, on one process and with each
sequence split over cp 2 x tp 2 (4 gloo ranks): the shares summed and the router's
gradient summed over the ranks (by `fp.distribute`) equal one process's; one all-reduce
a forward, none in a checkpoint's recompute; refusals on every rank.

The loss is a sum over a sequence's tokens, so how the sequence is cut over the ranks
does not matter: the ranks here hold contiguous, uneven pieces (the zigzag layout is
another permutation of the same tokens).
"""

import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fusedpar as fp
from fusedpar.nn.specs import MoESpec
from fusedpar.testing import HostSyncs, assert_close, exception_of
from fusedpar.testing.strategies import randn

D, H = 8, 4  # d_model, the experts' width (their outputs are not under test here)
ALPHA = 0.3


def _reference(x, router, top_k, score, expert_bias=None, capacity=None):
    """Eq. 17-20 in x's dtype, a loop over the B sequences of x (B, S, d): the loss and
    its gradient with respect to `router` (E, d)."""
    router = router.detach().clone().requires_grad_()
    E, losses = router.shape[0], []
    for seq in x:  # (S, d)
        scores = seq @ router.T  # (S, E)
        scores = scores.softmax(-1) if score == "softmax" else scores.sigmoid()
        select = scores if expert_bias is None else scores + expert_bias
        chosen = torch.zeros_like(scores).scatter(-1, select.detach().topk(top_k, -1).indices, 1.0)
        f = E / (top_k * seq.shape[0]) * chosen.sum(0)  # before any capacity drop
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append(ALPHA * (f * p).sum())
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), router.grad


def _stacks(E, seed, dtype):
    """Full router and expert stacks (E, ...), exact in `dtype`; the router skewed so that
    expert 0 draws more tokens than the rest."""
    router = randn((E, D), torch.float64, seed, exact_in=dtype)
    router[0] += 0.5
    w1, w3 = (randn((E, H, D), torch.float64, seed + i, exact_in=dtype) for i in (1, 2))
    return router, w1, randn((E, D, H), torch.float64, seed + 3, exact_in=dtype), w3


def _layer(stacks, top_k, score, dtype, placement=None, **options):
    E = stacks[0].shape[0]
    spec = MoESpec(D, H, E, top_k, score=score, aux_loss="sequence", aux_loss_coef=ALPHA, **options)
    layer = fp.nn.MoE.from_spec(spec, placement, dtype=dtype)
    layer.load_dense(*(t.to(dtype) for t in stacks))
    return layer


@given(
    p=st.fixed_dictionaries(
        dict(
            B=st.sampled_from([1, 3]),
            S=st.sampled_from([1, 5, 7]),
            E=st.sampled_from([4, 6]),
            k=st.sampled_from([1, 2, 3]),
            score=st.sampled_from(["softmax", "sigmoid"]),
            dtype=st.sampled_from([torch.float32, torch.float64]),
            strided=st.booleans(),
            capacity=st.sampled_from([None, 0.5]),
            seed=st.integers(0, 2**16),
        )
    )
)
def test_one_process_matches_the_reference(p):
    B, S, E, k, dtype = p["B"], p["S"], p["E"], p["k"], p["dtype"]
    stacks = _stacks(E, p["seed"], dtype)
    layer = _layer(stacks, k, p["score"], dtype, capacity_factor=p["capacity"])
    bias = None
    if p["score"] == "sigmoid":  # a selection bias: it steers f, never P
        bias = randn((E,), torch.float64, p["seed"] + 5, scale=0.2, exact_in=torch.float32)
        layer.expert_bias.copy_(bias)
    x64 = randn((S, B, D), torch.float64, p["seed"] + 6, exact_in=dtype).transpose(0, 1)
    x = x64.to(dtype)  # (B, S, d), strided: a sequence-first tensor's view
    if not p["strided"]:
        x, x64 = x.contiguous(), x64.contiguous()
    _, aux = layer(x)
    aux.backward()
    ref, ref_grad = _reference(x64, stacks[0], k, p["score"], bias)
    mine, mine_grad = _reference(x64.to(dtype), stacks[0].to(dtype), k, p["score"], bias)
    assert aux.dtype == dtype
    assert_close(aux.reshape(1), ref.reshape(1), mine.reshape(1), name="aux")
    assert_close(layer.router_weight.grad, ref_grad, mine_grad, name="d router_weight")
    if bias is not None:
        assert torch.equal(layer.expert_bias, bias.float())  # untouched, and no parameter
        assert "expert_bias" not in dict(layer.named_parameters())


def test_one_process_edges():
    """No host sync; no token or no sequence: 0 with a gradient; "switch" the default;
    refusals; reentrant checkpointing with no group (the recompute's counts are right)."""
    stacks = _stacks(4, 0, torch.float64)
    layer = _layer(stacks, 2, "softmax", torch.float64)
    with HostSyncs() as syncs:  # the counts: a scatter-add, on the device
        layer(torch.randn(3, 5, D, dtype=torch.float64))
    assert syncs.found == []
    for shape in ((2, 0, D), (0, 3, D)):  # no token, no sequence: 0, and a gradient
        _, aux = layer(torch.randn(shape, dtype=torch.float64))
        assert aux.item() == 0.0 and aux.requires_grad
    assert fp.nn.MoE(D, H, 4, 2).aux_loss == "switch" == MoESpec(D, H, 4, 2).aux_loss
    with pytest.raises(ValueError, match=r"aux_loss must be one of \('switch', 'sequence'\)"):
        MoESpec(D, H, 4, 2, aux_loss="global")
    with pytest.raises(ValueError, match=r"x \(B, S_local, d_model=8\).*got \(6, 8\)"):
        layer(torch.randn(6, D, dtype=torch.float64))
    x = torch.randn(3, 5, D, dtype=torch.float64, requires_grad=True)
    grads = []
    for ckpt in (False, True):  # reentrant: with no group, the recompute's counts are right
        layer.zero_grad()
        _, aux = checkpoint(layer, x, use_reentrant=True) if ckpt else layer(x)
        aux.backward()
        grads.append(layer.router_weight.grad.clone())
    assert torch.equal(*grads) and grads[0].abs().sum() > 0


# --- cp 2 x tp 2 ------------------------------------------------------------------------------


def _split(x):
    """This rank's piece of every sequence of x (B, S, d): cut over cp, then over tp,
    contiguous and uneven (S = 11 -> 3, 3, 3, 2)."""
    rank = dist.get_rank()  # mesh (cp, tp): rank = 2 * cp_rank + tp_rank
    return torch.tensor_split(x, 4, dim=1)[rank]


class _AllReduces:
    """Counts `torch.distributed.all_reduce` calls on int64 tensors (counts, not the
    gradients `fp.distribute` reduces) while inside."""

    def __enter__(self):
        self.real, self.count = dist.all_reduce, 0

        def counted(tensor, *args, **kwargs):
            self.count += tensor.dtype == torch.int64
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def _run_split(score):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    B, S, E, k, dtype = 3, 11, 4, 2, torch.float64
    stacks, seed = _stacks(E, 7, dtype), 11
    x_full = randn((B, S, D), dtype, seed)
    bias = None
    if score == "sigmoid":
        bias = randn((E,), torch.float64, seed + 1, scale=0.2, exact_in=torch.float32)
    ref, ref_grad = _reference(x_full, stacks[0], k, score, bias)
    on_mesh = fp.Placement(cp_group=mesh["cp"], tp_group=mesh["tp"], ep_group=mesh["tp"])
    by_groups = dict(cp_group=mesh["cp"].get_group(), tp_group=mesh["tp"].get_group())
    results = {}
    for name in ("mesh", "groups"):
        if name == "mesh":  # as `parallelize` builds it: from the spec and the placement
            layer = _layer(stacks, k, score, dtype, on_mesh)
        else:  # the keywords, with process groups (and no EP)
            options = dict(score=score, aux_loss="sequence", aux_loss_coef=ALPHA)
            layer = fp.nn.MoE.from_dense(*stacks, top_k=k, **options, **by_groups)
        if bias is not None:
            layer.expert_bias.copy_(bias)
        if name == "mesh":  # the router's gradient: a partial sum over cp and tp
            fp.distribute(layer, mesh)
        x = _split(x_full)
        layer(x)  # the first call's checks
        grads = []
        for ckpt in (None, "plain", "policy"):  # recomputed: everything, or but the ops kept
            layer.zero_grad()
            with _AllReduces() as forward:
                if ckpt is None:
                    y, aux = layer(x)
                else:
                    context = {"context_fn": fp.checkpoint_policy()} if ckpt == "policy" else {}
                    y, aux = checkpoint(layer, x, use_reentrant=False, **context)
            with _AllReduces() as backward:
                aux.backward()
            total = aux.detach().clone()
            dist.all_reduce(total)
            grad = layer.router_weight.grad
            if name == "mesh":  # reduced after the backward, by `fp.distribute`
                grad = grad.full_tensor()
            else:  # by hand, as `fp.distribute` would
                grad = grad.clone()
                dist.all_reduce(grad)
            assert_close(total.reshape(1), ref.reshape(1), ref.reshape(1), name=f"{name} aux")
            assert_close(grad, ref_grad, ref_grad, name=f"{name} d router_weight")
            grads.append(grad)
            # mesh slices fold into one group; process groups are summed one at a time
            assert forward.count == (1 if name == "mesh" else 2) and backward.count == 0
        assert all(torch.equal(grads[0], g) for g in grads)  # the forward's counts
        results[name] = len(layer.sequence_groups)
    silent = fp.nn.MoE.from_dense(*stacks, top_k=k, aux_loss="sequence", aux_loss_coef=0.0)
    with _AllReduces() as zero:  # alpha 0: no collective
        silent(x)
    return results == {"mesh": 1, "groups": 2} and zero.count == 0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_shares_over_cp_and_tp_sum_to_one_process(world, score):
    assert all(world(4).run(_run_split, score))


def _run_refusal(case):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    placement = fp.Placement(cp_group=mesh["cp"], tp_group=mesh["tp"], ep_group=mesh["tp"])
    if case == "batch, EP over dp":  # ranks 0, 1 share no sequence group with rank 3
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        placement = fp.Placement(cp_group=mesh["cp"], ep_group=mesh["dp"])
    layer = _layer(_stacks(4, 0, torch.float32), 2, "softmax", torch.float32, placement)
    x = torch.randn(3, 2, D)
    if case == "2-D" and dist.get_rank() == 0:
        x = x[0]
    if case.startswith("batch") and dist.get_rank() == 3:
        x = x[:2]
    if case == "reentrant":
        layer(x)
        _, aux = checkpoint(layer, x.requires_grad_(), use_reentrant=True)
        aux.backward()
    layer(x)


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("2-D", ValueError, r"x \(B, S_local, d_model=8\).*got \(2, 8\)"),
        ("batch", ValueError, r"sequences"),
        ("batch, EP over dp", ValueError, r"sequences"),
        ("reentrant", RuntimeError, r"use_reentrant=False"),
    ],
)
def test_refusals_on_every_rank(world, case, error, match):
    for e in world(4).run(exception_of, _run_refusal, case):
        assert isinstance(e, error) and re.search(match, str(e)), repr(e)


def _run_compiled():
    stacks = [t.float() for t in _stacks(4, 3, torch.float32)]
    options = dict(score="sigmoid", aux_loss="sequence", aux_loss_coef=ALPHA)
    layer = fp.nn.MoE.from_dense(*stacks, top_k=2, cp_group=dist.group.WORLD, **options)
    x = randn((3, 4, D), torch.float32, 20 + dist.get_rank())
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        layer.zero_grad()
        _, aux = run(x)
        aux.backward()
        grads.append((aux.detach(), layer.router_weight.grad.clone()))
    (eager, d_eager), (compiled, d_compiled) = grads
    return torch.allclose(eager, compiled) and torch.allclose(d_eager, d_compiled)


def test_compiles_full_graph_with_its_collective(world):
    assert all(world(2).run(_run_compiled))
