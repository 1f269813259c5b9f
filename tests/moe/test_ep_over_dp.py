"""Experts over data-parallel ranks (#57 item 1) on 4 gloo ranks, float64, torch's
implementation: the loss, every parameter's gradient after reduction and two AdamW
steps equal one process's, at EP 4 over dp 4 (FSDP2 over the dense parameters), EP 4
over dp 2 x tp 2, EP 2 over dp beside tp 2, and EP 2 over the inner half of dp 4
(the experts FSDP2-sharded over the outer half); each reduction counted with its group.

The model: a norm, a MoE (router bias, expert biases, a shared expert; no auxiliary
loss: a rank's Switch loss is over its own tokens, so it is not one process's) and a
head. Rank (d, t) holds tokens ``X[d, t]``; its loss is its tokens' share of dp batch
d's mean, so the tp ranks' losses sum to the batch's and data parallelism averages
the batches: one process's loss is the mean over every token.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fusedpar as fp
from fusedpar import comm
from fusedpar.testing import Collectives

D, H, E, N = 8, 6, 8, 5  # model width, expert width, experts, tokens a rank


class _Tiny(nn.Module):
    def __init__(self, ep_group):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.moe = fp.nn.MoE(
            D, H, E, 2, ep_group, shared_hidden=4, router_bias=True, bias=True, aux_loss_coef=0.0
        )
        self.head = nn.Linear(D, 3)
        with torch.no_grad():  # random, not the zeros and ones that hide a dropped one
            self.norm.weight.uniform_(0.5, 1.5)
            for name in ("router_bias", "b1", "b2", "b3"):
                getattr(self.moe, name).normal_()

    def forward(self, x):
        y, _ = self.moe(self.norm(x))
        return self.head(y)


def _full_model():
    torch.manual_seed(0)
    return _Tiny(None).double()


def _tokens(dp: int, tp: int):
    return torch.randn(
        dp, tp, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )


def _loss(out, share):
    return out.square().sum() / share


def _built(layout):
    """The model at `layout`: the full model's parameters, this rank's experts; placed
    (`fp.distribute`) and, with ``layout["fsdp"]``, sharded by FSDP2."""
    dims = fp.ParallelDims(**layout.get("dims", {}))
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    # built by hand: ParallelDims without ep, the layer given the dp group itself
    ep_group = mesh["dp"].get_group() if layout.get("by_hand") else groups["ep"]
    full = _full_model()
    torch.manual_seed(0)
    model = _Tiny(ep_group).double()
    shard = E // comm.group_size(ep_group)
    rank = comm.group_rank(ep_group)
    with torch.no_grad():  # the full model's experts, this EP rank's share
        for name, param in model.named_parameters():
            source = full.get_parameter(name)
            is_expert = name.split(".")[-1] in ("w1", "w2", "w3", "b1", "b2", "b3")
            param.copy_(source[rank * shard : (rank + 1) * shard] if is_expert else source)
    fp.distribute(model, mesh)
    if layout.get("fsdp"):  # "tp path": FSDP2's path of torch 2.11 (on the mesh without dp)
        options = {}
        if layout.get("param_dtype"):  # FSDP2's mixed precision: the forward in that dtype
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=layout["param_dtype"])
        dims.fully_shard(model, mesh, dp_mesh_dims=layout["fsdp"] != "tp path", **options)
    return dims, groups, model


def _run(layout, steps=2):
    """This rank's loss, its parameters' reduced gradients (full tensors) and its
    parameters after `steps` AdamW steps; the reductions of the first backward."""
    dims, groups, model = _built(layout)
    d = groups["dp"].get_local_rank() if dims.dp > 1 else 0
    t = groups["tp"].get_local_rank() if dims.tp > 1 else 0
    x = _tokens(dims.dp, dims.tp)[d, t]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    out = {}
    for step in range(steps):
        with Collectives() as seen:
            loss = _loss(model(x), dims.tp * N)
            loss.backward()
        if step == 0:
            total = loss.detach().clone()
            dist.all_reduce(total)
            out["loss"] = total.item() / dims.dp
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
            # clips by it: one mesh, torch's own; two (part of dp, torch 2.11's path), ours
            out["norm"] = fp.clip_grad_norm_(model.parameters(), float("inf")).item()
            out["reductions"] = seen.calls
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _reference(dp, tp, steps=2):
    model = _full_model()
    x = _tokens(dp, tp).reshape(-1, D)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    for step in range(steps):
        loss = _loss(model(x), x.shape[0])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
            ref = {"loss": loss.item(), "grads": grads, "norm": norm}
        optimizer.step()
        optimizer.zero_grad()
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ref


LAYOUTS = {
    "ep4 over dp4, FSDP2": {"dims": {"dp": 4, "ep": "dp"}, "fsdp": True},
    "ep4 over dp4 by hand, FSDP2's torch 2.11 path": {
        "dims": {"dp": 4},
        "by_hand": True,
        "fsdp": "tp path",
    },
    "ep4 over dp2 x tp2": {"dims": {"dp": 2, "tp": 2, "ep": ("dp", "tp")}},
    "ep2 over dp2 beside tp2": {"dims": {"dp": 2, "tp": 2, "ep": "dp"}},
    "ep2 over half of dp4, FSDP2": {"dims": {"dp": 4, "ep": "dp", "ep_degree": 2}, "fsdp": True},
}


# Bytes (float64) of what each reduction carries: the norm and head (8 + 24 + 3), the
# MoE's router and shared expert (64 + 8 + 3 x 32), and an EP rank's k experts
# (k x 164: w1, w2, w3 48 each, b1, b3 6, b2 8). FSDP2 pads a parameter's dim 0 to a
# multiple of its shards and counts the output too: a reduce-scatter over n carries
# (1 + 1/n) x the padded sizes (head.weight 3 -> 4 rows, head.bias 3 -> 4 at n = 4).
DENSE, MOE_DENSE = 8 * (8 + 24 + 3), 8 * (64 + 8 + 96)
EXPERTS = 8 * 164
REDUCTIONS = {  # layout -> rank -> the first backward's reductions: (kind, group, bytes)
    "ep4 over dp4, FSDP2": lambda r: [("reduce_scatter", (0, 1, 2, 3), 8 * 212 * 5 // 4)],
    "ep4 over dp2 x tp2": lambda r: [("all_reduce", (0, 1, 2, 3), DENSE + MOE_DENSE)],
    "ep2 over dp2 beside tp2": lambda r: [
        ("all_reduce", (0, 1, 2, 3), DENSE + MOE_DENSE),
        ("all_reduce", (r - r % 2, r - r % 2 + 1), 4 * EXPERTS),  # over tp: its tokens'
    ],
    "ep2 over half of dp4, FSDP2": lambda r: [
        # FSDP2 of the MoE over dp_mod_ep: its router and shared expert first averaged over
        # dp_in_ep (one all-reduce each), then the whole layer reduce-scattered
        *[("all_reduce", (r - r % 2, r - r % 2 + 1), 8 * n) for n in (64, 8, 32, 32, 32)],
        ("reduce_scatter", (r % 2, r % 2 + 2), 4 * EXPERTS * 3 // 2 + MOE_DENSE * 3 // 2),
        ("reduce_scatter", (0, 1, 2, 3), 8 * (8 + 32 + 4) * 5 // 4),
    ],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_matches_one_process_and_reduces_each_gradient_once(world, name):
    """The loss, every reduced gradient, their total norm (`fp.clip_grad_norm_`'s) and the
    parameters after two AdamW steps equal one process's (float64: the order of sums
    differs, 1e-11). No gradient reduced twice or missed: each rank's reductions in the
    first backward, with their groups and bytes, are exactly its parameters' (experts over
    all of dp: none; beside tp: summed over tp; over half of dp: over the other half)."""
    layout = LAYOUTS[name]
    dims = layout["dims"]
    ref = _reference(dims["dp"], dims.get("tp", 1))
    expected = REDUCTIONS.get(name, REDUCTIONS["ep4 over dp4, FSDP2"])
    for rank, out in enumerate(world(4).run(_run, layout)):
        assert abs(out["loss"] - ref["loss"]) <= 1e-12 * abs(ref["loss"])
        for what in ("grads", "params"):
            for n, want in ref[what].items():
                err = (out[what][n] - want).abs().max().item()
                assert err <= 1e-11 * max(1.0, want.abs().max().item()), (name, what, n, err)
        got = [c for c in out["reductions"] if c[0] in ("all_reduce", "reduce_scatter")]
        assert sorted(got) == sorted(expected(rank)), (name, rank, got)
        if "norm" in out:
            assert abs(out["norm"] - ref["norm"]) <= 1e-12 * ref["norm"], (name, out["norm"])


def _run_checkpoint(layout, load_from, save_to):
    """Trained a step (``load_from`` None) or loaded from ``load_from``, then saved to
    ``save_to``: every parameter and AdamW state as full tensors."""
    dims, groups, model = _built(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    if load_from is None:
        d = groups["dp"].get_local_rank() if dims.dp > 1 else 0
        t = groups["tp"].get_local_rank() if dims.tp > 1 else 0
        _loss(model(_tokens(dims.dp, dims.tp)[d, t]), dims.tp * N).backward()
        optimizer.step()
    else:
        fp.checkpoint.load(load_from, model, optimizer)
    fp.checkpoint.save(save_to, model, optimizer)
    out = {}
    for name, param in model.named_parameters():
        out[name] = _full(param)
        for key, value in optimizer.state[param].items():
            out[f"{name}.{key}"] = _full(value)
    return out


CHAIN = [  # (ranks, layout, the step whose checkpoint it loads)
    (4, {"dims": {"dp": 2, "tp": 2, "ep": ("dp", "tp")}}, None),
    (4, {"dims": {"dp": 2, "tp": 2, "ep": "tp"}, "fsdp": True}, 0),
    (1, {}, 0),  # one process
    (4, {"dims": {"dp": 4}, "fsdp": True}, 2),  # no EP: every expert on every rank
    (4, {"dims": {"dp": 4, "ep": "dp", "ep_degree": 2}, "fsdp": True}, 3),  # experts' shards
    (4, {"dims": {"dp": 4, "ep": "dp"}, "fsdp": True}, 4),
]


def test_checkpoints_move_between_ep_layouts_bit_for_bit(world, tmp_path):
    """A checkpoint written at EP over dp 2 x tp 2 loads at EP over tp 2 and in one
    process; that one's at no EP (dp 4), at EP 2 over half of dp 4 (the experts
    FSDP2-sharded over the other half) and back at EP over all of dp 4, each saving for
    the next: every parameter and AdamW moment equal to the first's, bit for bit."""
    first = None
    for i, (ranks, layout, source) in enumerate(CHAIN):
        load_from = None if source is None else str(tmp_path / f"step-{source}")
        got = world(ranks).run(_run_checkpoint, layout, load_from, str(tmp_path / f"step-{i}"))[0]
        first = first or got
        assert sorted(got) == sorted(first)
        for name, tensor in first.items():
            assert torch.equal(got[name], tensor), (layout, name)


def _run_unequal_expert_replicas():
    """EP 2 over half of dp 4: each expert shard is held by the 2 ranks of dp_mod_ep, which
    must hold it equal; one rank's drawn differently is named, on every rank."""
    dims = fp.ParallelDims(dp=4, ep="dp", ep_degree=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = _Tiny(dims.groups(mesh)["ep"]).double()
    if dist.get_rank() == 3:
        with torch.no_grad():
            model.moe.w2.add_(1e-3)
    try:
        fp.distribute(model, mesh)
    except ValueError as e:
        return str(e)
    return None


def test_experts_unequal_across_their_replicas_are_named(world):
    for message in world(4).run(_run_unequal_expert_replicas):
        assert (
            message is not None
            and "moe.w2 differ across the ranks of mesh axis 'dp_mod_ep'" in message
        ), message


@pytest.mark.parametrize("ep_degree", [None, 2], ids=["all of dp", "half of dp"])
def test_mixed_precision_casts_the_experts_fsdp2_leaves_alone(world, ep_degree):
    """FSDP2's MixedPrecisionPolicy(param_dtype=float32) on the float64 model: FSDP2 casts
    what it manages, and the swap hook the experts it ignores (EP over all of dp), so the
    MoE takes float32 inputs and experts (before: "x is float32 but the experts are
    float64"); the gradients land in float64, within float32's rounding of one process's."""
    dims = {"dp": 4, "ep": "dp", "ep_degree": ep_degree}
    layout = {"dims": dims, "fsdp": True, "param_dtype": torch.float32}
    ref = _reference(4, 1, steps=1)
    for out in world(4).run(_run, layout, 1):
        assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        for n, want in ref["grads"].items():
            got = out["grads"][n]
            assert got.dtype == torch.float64, n
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), (n, err)


def _run_clipped(layout, max_norm):
    """Every gradient after ``fp.clip_grad_norm_(..., max_norm)``, as full tensors."""
    dims, groups, model = _built(layout)
    x = _tokens(dims.dp, 1)[groups["dp"].get_local_rank(), 0]
    _loss(model(x), N).backward()
    total = fp.clip_grad_norm_(model.parameters(), max_norm)
    return total.item(), {n: _full(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "name", ["ep2 over half of dp4, FSDP2", "ep4 over dp4 by hand, FSDP2's torch 2.11 path"]
)
def test_clipping_over_two_meshes(world, name):
    """Where FSDP2 leaves the parameters on two meshes (torch's clip_grad_norm_ cannot
    stack their norms), `fp.clip_grad_norm_` clips every gradient by one process's norm."""
    ref = _reference(4, 1, steps=1)
    norm = torch.nn.utils.get_total_norm(list(ref["grads"].values())).item()
    for total, grads in world(4).run(_run_clipped, LAYOUTS[name], norm / 2):
        assert abs(total - norm) <= 1e-12 * norm
        for n, want in ref["grads"].items():
            err = (grads[n] - want * (norm / 2) / (norm + 1e-6)).abs().max().item()
            assert err <= 1e-11 * max(1.0, want.abs().max().item()), (n, err)
