"""`fp.distribute`: every parameter a DTensor on the full mesh, with the placements its
layer declares; the gradients of whole parameters (a norm, a row-parallel bias) summed
over the ranks whose tokens they saw, with no list of names; clipping and foreach/fused
AdamW on the result; and the misuse errors. The whole-model gradient checks against a
single device are in test_examples.py."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import fusedpar as fp
from fusedpar.testing import assert_close


def _mesh(dp=1, cp=2, tp=2, ep=None):
    dims = fp.ParallelDims(dp=dp, cp=cp, tp=tp, ep=ep)
    mesh = dims.build_mesh("cpu")
    return dims, mesh, dims.groups(mesh)


def _run_placements():
    """Every layer kind on (dp=1, cp=2, tp=2): placements, global shapes, local data."""
    _, mesh, groups = _mesh(ep="tp")
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(10, 16),
            "norm": nn.RMSNorm(16),
            "col": fp.nn.ColumnParallelLinear(16, 8, groups["tp"]),
            "row": fp.nn.RowParallelLinear(8, 16, groups["tp"]),
            "mlp": fp.nn.ParallelSwiGLU(16, 12, groups["tp"]),
            "attn": fp.nn.ParallelAttention(16, 2, tp_group=groups["tp"], cp_group=groups["cp"]),
            "moe": fp.nn.MoE(16, 6, 4, 2, groups["ep"]),
            "oss": fp.nn.MoE(
                16, 6, 4, 2, groups["ep"], bias=True, router_bias=True, activation="clamped_swiglu"
            ),
            "head": nn.Linear(16, 10, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight  # tied
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fp.distribute(model, mesh)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    expected = {  # name: (placements on (dp, cp, tp), global shape)
        "embed.weight": ((R, R, R), (10, 16)),
        "norm.weight": ((R, R, R), (16,)),
        "col.weight": ((R, R, S0), (8, 16)),
        "col.bias": ((R, R, S0), (8,)),
        "row.weight": ((R, R, S1), (16, 8)),
        "row.bias": ((R, R, R), (16,)),
        "mlp.gate_weight": ((R, R, S0), (12, 16)),
        "mlp.up_weight": ((R, R, S0), (12, 16)),
        "mlp.down_weight": ((R, R, S1), (16, 12)),
        "attn.q_weight": ((R, R, S0), (16, 16)),
        "attn.k_weight": ((R, R, S0), (16, 16)),
        "attn.v_weight": ((R, R, S0), (16, 16)),
        "attn.o_weight": ((R, R, S1), (16, 16)),
        "moe.router_weight": ((R, R, R), (4, 16)),
        "moe.w1": ((R, R, S0), (4, 6, 16)),
        "moe.w2": ((R, R, S0), (4, 16, 6)),
        "moe.w3": ((R, R, S0), (4, 6, 16)),
        "oss.router_weight": ((R, R, R), (4, 16)),
        "oss.router_bias": ((R, R, R), (4,)),
        "oss.w1": ((R, R, S0), (4, 6, 16)),
        "oss.w2": ((R, R, S0), (4, 16, 6)),
        "oss.w3": ((R, R, S0), (4, 6, 16)),
        "oss.b1": ((R, R, S0), (4, 6)),
        "oss.b2": ((R, R, S0), (4, 16)),
        "oss.b3": ((R, R, S0), (4, 6)),
    }
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(expected)  # the tied head is the embedding's parameter
    assert model["head"].weight is model["embed"].weight
    for name, (placements, shape) in expected.items():
        p = params[name]
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        assert p.placements == placements and tuple(p.shape) == shape, (name, p.placements)
        assert torch.equal(p.to_local(), before[name]), name
    # layers still load dense weights, into the local shards
    full = torch.randn(8, 16)
    model["col"].load_dense(full, torch.zeros(8))
    assert torch.equal(model["col"].weight.full_tensor(), full)
    # experts over the flattened (cp, tp) pair: Shard(0) on both, in the group's order
    moe = fp.distribute(fp.nn.MoE(16, 6, 4, 2, mesh["cp", "tp"]._flatten("cp_tp")), mesh)
    assert moe.w1.placements == (R, S0, S0) and moe.w1.to_local().shape == (1, 6, 16)
    stacks = [
        torch.randn(4, 16),
        torch.randn(4, 6, 16),
        torch.randn(4, 16, 6),
        torch.randn(4, 6, 16),
    ]
    moe.load_dense(*stacks)
    loaded = (moe.router_weight, moe.w1, moe.w2, moe.w3)  # load_dense's order
    assert all(torch.equal(p.full_tensor(), t) for p, t in zip(loaded, stacks, strict=True))
    return True


def test_every_layer_places_its_parameters(world):
    assert all(world(4).run(_run_placements))


def _sharded(t, groups):
    """(T, ...) -> this rank's tokens: split over dp, cp, then tp (sequence parallel)."""
    for axis in ("dp", "cp", "tp"):
        t = t.chunk(fp.comm.group_size(groups[axis]))[fp.comm.group_rank(groups[axis])]
    return t


def _run_whole_parameter_gradients(dp, cp, seed, frozen=False):
    """norm -> column (bias) -> gelu -> row (bias), tokens split over dp, cp and tp, no
    FSDP: every gradient, whole parameters included, equals the dense model's (dp
    averages, so each dp rank's loss counts dp times). ``frozen``: the norm's weight is
    frozen when distributed and trained after, reduced all the same."""
    _, mesh, groups = _mesh(dp=dp, cp=cp, tp=2)
    torch.manual_seed(seed)
    d, h, tokens = 8, 12, 8
    norm, up, down = nn.RMSNorm(d), nn.Linear(d, h), nn.Linear(h, d)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, g = torch.randn(tokens, d), torch.randn(tokens, d)

    def dense(dtype):
        mods = [m.to(dtype) for m in (norm, up, down)]
        for m in mods:
            m.zero_grad()
        (down(F.gelu(up(norm(x.to(dtype))))) * g.to(dtype)).sum().backward()
        return {
            f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
        }

    ref64, ref32 = dense(torch.float64), dense(torch.float32)
    column = fp.nn.ColumnParallelLinear.from_dense(up, groups["tp"])
    model = nn.Sequential(
        norm, column, nn.GELU(), fp.nn.RowParallelLinear.from_dense(down, groups["tp"])
    )
    norm.weight.requires_grad_(not frozen)
    fp.distribute(model, mesh)
    model[0].weight.requires_grad_(True)
    (dp * model(_sharded(x, groups)) * _sharded(g, groups)).sum().backward()
    names = {
        "0.weight": "0.weight",
        "1.weight": "1.weight",
        "1.bias": "1.bias",
        "3.weight": "2.weight",
        "3.bias": "2.bias",
    }
    for name, p in model.named_parameters():
        assert p.grad.placements == p.placements, (name, p.grad.placements)  # reduced
        assert_close(p.grad.full_tensor(), ref64[names[name]], ref32[names[name]], name=name)
    return True


@pytest.mark.parametrize("dp, cp, frozen", [(1, 2, False), (2, 1, False), (1, 2, True)])
def test_whole_parameters_get_whole_gradients(world, dp, cp, frozen):
    assert all(world(4).run(_run_whole_parameter_gradients, dp, cp, 0, frozen))


def _run_clip_and_optimizers(kind, fsdp):
    """clip_grad_norm_ over DTensor parameters is the dense norm, and foreach or fused
    AdamW takes the dense model's step. (dp=2, tp=2), classic TP: dp averages, by the
    hooks (``fsdp=None``) or by FSDP2 applied per layer, its hooks and ours on the same
    module (True: this torch's path; False: the torch 2.11 path)."""
    dims, mesh, groups = _mesh(dp=2, cp=1, tp=2)
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(8, 12, bias=False), nn.GELU(), nn.Linear(12, 8))
    x = torch.randn(4, 8)
    model = nn.Sequential(
        fp.nn.ColumnParallelLinear.from_dense(dense[0], groups["tp"], sequence_parallel=False),
        nn.GELU(),
        fp.nn.RowParallelLinear.from_dense(dense[2], groups["tp"], sequence_parallel=False),
    )
    fp.distribute(model, mesh, token_axes=())  # the tokens are whole over tp
    if fsdp is not None:
        for module in (model[0], model[2], model):
            dims.fully_shard(module, mesh, dp_mesh_dims=None if fsdp else False)
    model(x.chunk(2)[mesh["dp"].get_local_rank()]).square().mean().backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
    torch.optim.AdamW(model.parameters(), lr=0.1, **{kind: True}).step()

    (sum(dense(half).square().mean() for half in x.chunk(2)) / 2).backward()
    dense_norm = nn.utils.clip_grad_norm_(dense.parameters(), max_norm=0.01)
    torch.optim.AdamW(dense.parameters(), lr=0.1).step()
    torch.testing.assert_close(norm.full_tensor(), dense_norm, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("kind, fsdp", [("foreach", None), ("fused", True), ("foreach", False)])
def test_clipping_and_foreach_and_fused_adamw(world, kind, fsdp):
    assert all(world(4).run(_run_clip_and_optimizers, kind, fsdp))


def _run_misuse(case):
    """Each misuse raises ValueError on every rank, before any collective."""
    _, mesh, groups = _mesh()
    try:
        if case == "classic tp with split tokens":
            fp.distribute(
                fp.nn.ColumnParallelLinear(8, 8, groups["tp"], sequence_parallel=False), mesh
            )
        elif case == "group not on the mesh":  # pairs (0, 3) and (1, 2): no mesh axis
            pairs = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            pg = pairs[0] if dist.get_rank() in (0, 3) else pairs[1]
            fp.distribute(fp.nn.ColumnParallelLinear(8, 8, pg), mesh)
        elif case == "cp left out of token_axes":
            attn = fp.nn.ParallelAttention(16, 2, tp_group=groups["tp"], cp_group=groups["cp"])
            fp.distribute(attn, mesh, token_axes=("tp",))
        elif case == "multihead attention":
            fp.distribute(nn.Sequential(nn.MultiheadAttention(8, 2)), mesh)
        elif case == "twice":
            layer = nn.Linear(4, 4)
            fp.distribute(layer, mesh)
            fp.distribute(layer, mesh)
        elif case == "unknown axis":
            fp.distribute(nn.Linear(4, 4), mesh, token_axes=("sp",))
        elif case == "tp and cp swapped":
            attn = fp.nn.ParallelAttention(16, 2, tp_group=groups["cp"], cp_group=groups["tp"])
            fp.distribute(attn, mesh)
        elif case == "seeded per rank":  # the norm differs across all ranks, the shards over cp
            torch.manual_seed(dist.get_rank())
            model = nn.Sequential(nn.RMSNorm(8), fp.nn.ColumnParallelLinear(8, 8, groups["tp"]))
            nn.init.uniform_(model[0].weight)
            fp.distribute(model, mesh)
        elif case == "shards differ over cp":  # the same seed within each cp rank only
            torch.manual_seed(fp.comm.group_rank(groups["cp"]))
            fp.distribute(fp.nn.ColumnParallelLinear(8, 8, groups["tp"]), mesh)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case, match",
    [
        ("classic tp with split tokens", r"sequence_parallel=False over \('tp',\).*token_axes"),
        ("group not on the mesh", r"ranks \[(0, 3|1, 2)\] is not an axis"),
        ("cp left out of token_axes", r"splits the sequence over \('cp',\), but token_axes"),
        ("multihead attention", r"0 is an nn.MultiheadAttention, whose forward reads its children"),
        ("twice", r"weight is already a DTensor"),
        ("unknown axis", r"token_axes \['sp'\] are not axes"),
        ("tp and cp swapped", r"ParallelAttention.tp_group is the mesh's cp axis, not tp"),
        (
            "seeded per rank",
            r"0.weight, 1.weight, 1.bias differ across the ranks of mesh axis 'cp'",
        ),
        (
            "shards differ over cp",
            r"^distribute: weight, bias differ across .* axis 'cp'.* same seed",
        ),
    ],
)
def test_misuse_raises_on_every_rank(world, case, match):
    messages = world(4).run(_run_misuse, case)
    assert all(m is not None and re.search(match, m) for m in messages), messages


def _run_undistributed(distributed):
    """A layer over 2 ranks trained without `distribute` warns once, naming it; after
    `distribute`, or without grad, it does not."""
    import warnings

    import fusedpar.storage

    fusedpar.storage._warned_undistributed = False
    _, mesh, groups = _mesh(cp=1, tp=2)
    torch.manual_seed(0)
    layer = fp.nn.ColumnParallelLinear(8, 8, groups["tp"], sequence_parallel=False)
    if distributed:
        fp.distribute(layer, mesh, token_axes=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            layer(torch.randn(2, 8))
        layer(torch.randn(2, 8)).sum().backward()
        layer(torch.randn(2, 8)).sum().backward()
    return [str(w.message) for w in caught if "fusedpar.distribute" in str(w.message)]


def test_training_without_distribute_warns_once(world):
    warned = world(2).run(_run_undistributed, False)
    assert all(
        len(w) == 1 and "ColumnParallelLinear runs over more than one rank" in w[0] for w in warned
    ), warned
    assert world(2).run(_run_undistributed, True) == [[], []]


def _run_data_axis_and_retired():
    """On (dp=2, tp=2): experts built by hand over dp (``ep_group=mesh["dp"]``) or dp x
    tp are placed split there, their gradient scaled by 1 / the dp ranks of the group
    (#57; tests/moe/test_ep_over_dp.py checks the numbers); a layer declaring a
    parameter partial over dp is refused on every rank, before anything changes.
    Optimizers (AdamW, SGD) built before `distribute`, or before `fully_shard`, raise at
    their first step; built after, they step unchanged."""
    from fusedpar.storage import ParamLayout, _checked

    dims, mesh, groups = _mesh(dp=2, cp=1, tp=2, ep="tp")
    out = {}
    torch.manual_seed(0)
    for name, group in (("dp", mesh["dp"].get_group()), ("dp x tp", mesh["dp", "tp"]._flatten())):
        moe = fp.distribute(fp.nn.MoE(8, 6, 4, 2, group), mesh)
        out[name] = (moe.w1.placements, moe._fusedpar_placed["w1"].grad_scale)

    class PartialOverDp(nn.Linear):
        def param_layouts(self):
            return {"weight": ParamLayout(partial_over=(mesh["dp"],)), "bias": ParamLayout()}

    layer = PartialOverDp(4, 4)
    try:
        fp.distribute(layer, mesh)
    except ValueError as e:
        out["partial"] = str(e)
    out["partial unchanged"] = not any(isinstance(p, DTensor) for p in layer.parameters())

    torch.manual_seed(0)
    model = nn.ModuleDict({"norm": nn.RMSNorm(8), "moe": fp.nn.MoE(8, 6, 4, 2, groups["ep"])})
    early = [torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters())]
    fp.distribute(model, mesh)
    out["experts"] = model["moe"].w1.placements  # (dp, cp, tp)
    for opt in early:
        try:
            opt.step()
        except ValueError as e:
            out[type(opt).__name__] = str(e)
    late = [torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters())]
    x = torch.randn(4, 8)
    before = model["moe"].w1.to_local().clone()
    for opt in late:
        y, aux = model["moe"](model["norm"](x))
        (y.square().mean() + aux).backward()
        opt.step()
        opt.step()  # a second step: the optimizer's verdict is kept (`_checked`)
        opt.zero_grad()
    out["trained"] = not torch.equal(model["moe"].w1.to_local(), before)
    out["checked once"] = all(opt in _checked for opt in late)

    layer = fp.distribute(nn.Linear(4, 4), mesh)
    early = torch.optim.SGD(layer.parameters())
    dims.fully_shard(layer, mesh)
    try:
        early.step()
    except ValueError as e:
        out["fully_shard"] = str(e)
    torch.optim.SGD(layer.parameters()).step()
    return out


def test_experts_over_dp_are_placed_and_early_optimizers_raise(world):
    """Experts over dp trained with gradients dp times too large (issue 53, item 3; now
    placed and scaled, #57); an optimizer built before distribute trained nothing (item 4)."""
    R, S0 = Replicate(), Shard(0)
    for out in world(4).run(_run_data_axis_and_retired):
        assert out["dp"] == ((S0, R, R), 0.5)
        assert out["dp x tp"] == ((S0, R, S0), 0.5)
        assert re.search(
            r"weight \(PartialOverDp\) is declared partial over the mesh's data-parallel "
            r"axis 'dp' \(2 ranks\)",
            out["partial"],
        ), out
        assert out["partial unchanged"]
        assert out["experts"] == (R, R, S0)
        for kind in ("AdamW", "SGD"):
            assert re.search(
                rf"^{kind}\.step: the optimizer holds (norm|moe)\.\w+, a parameter "
                r"that distribute replaced.*build the optimizer after "
                r"distribute$",
                out[kind],
            ), out[kind]
        assert out["trained"] and out["checked once"]
        assert out["fully_shard"].endswith("build the optimizer after fully_shard"), out


def _run_local_views_match_to_local():
    """The forward pre-hook's swap (`fusedpar.local_params.local_views`, one autograd node
    for a module's parameters) against ``to_local(grad_placements=...)`` per parameter on
    (dp 1, cp 2, tp 2): the same local values, and each gradient the same DTensor
    (placements, global shape and stride, dtype, local values and strides), from the
    kept specs too (second round), for a transposed gradient as well; an unused
    parameter gets none; a double backward (``create_graph``) is recorded. The hook of
    `fp.distribute` makes one such node per call; a frozen parameter's local does not
    require grad."""
    from fusedpar.local_params import local_views

    _, mesh, _ = _mesh()
    R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
    avg = Partial("avg")
    torch.manual_seed(0)
    cases = [
        ((R, R, S0), (avg, P, S0), (6, 8)),
        ((R, R, S1), (avg, R, S1), (8, 6)),
        ((R, R, R), (avg, P, P), (5,)),
    ]
    params = [
        nn.Parameter(DTensor.from_local(torch.randn(shape), mesh, placements))
        for placements, _, shape in cases
    ]
    grads, specs = [g for _, g, _ in cases], {}
    for _ in range(2):
        for create_graph in (False, True):
            ours = local_views(params, grads, specs)
            theirs = [p.to_local(grad_placements=g) for p, g in zip(params, grads, strict=True)]
            assert all(
                torch.equal(a, b) and a.stride() == b.stride() and a.requires_grad
                for a, b in zip(ours, theirs, strict=True)
            )
            w = torch.randn(2, 6, 8)  # the second parameter used transposed, the third not
            got, want = (
                torch.autograd.grad(
                    (t[0] * w[0]).sum() + (t[1].t() * w[1]).sum(),
                    params,
                    allow_unused=True,
                    create_graph=create_graph,
                )
                for t in (ours, theirs)
            )
            assert got[2] is None and want[2] is None
            assert got[1].to_local().stride() == (1, 8)  # transposed
            for a, b in zip(got[:2], want[:2], strict=True):
                assert type(a) is DTensor and a.placements == b.placements
                assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
                assert torch.equal(a.to_local(), b.to_local())
                assert a.to_local().stride() == b.to_local().stride()
    # distribute's hook makes one such node a call, whatever the number of parameters (it
    # made one `to_local` node each: ~60 us a parameter, docs/hot_path.md)
    layer = fp.distribute(nn.Linear(4, 3), mesh)
    nodes, todo = {}, [layer(torch.randn(2, 4)).grad_fn]
    while todo:
        node = todo.pop()
        nodes[node] = type(node).__name__
        todo.extend(n for n, _ in node.next_functions if n is not None and n not in nodes)
    names = list(nodes.values())
    assert names.count("_LocalViewsBackward") == 1 and "_ToTorchTensorBackward" not in names
    # a frozen parameter's local needs no gradient, as to_local's (its dW is not computed)
    layer.weight.requires_grad_(False)
    seen = []
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.weight.requires_grad))
    layer(torch.randn(2, 4)).sum().backward()
    assert seen == [False] and layer.weight.grad is None and layer.bias.grad is not None
    return True


def test_local_views_make_the_gradients_to_local_makes(world):
    assert all(world(4).run(_run_local_views_match_to_local))


def _run_local_accumulation_is_autograds():
    """`fusedpar.local_params` accumulates a parameter's gradient on its local tensor
    where AccumulateGrad would have accumulated the DTensor. Two copies of one model on
    (dp 1, cp 2, tp 2), one with that fast path turned off, take the same backwards:
    accumulating twice, after ``zero_grad``, ``autograd.grad`` (returned, not
    accumulated), ``backward(inputs=...)``, a tensor hook on one parameter, a hook on
    its AccumulateGrad node, post-accumulate-grad hooks, ``create_graph`` and compiled
    autograd: the same
    gradients bit for bit (placements, partial ones reduced), hooks called alike."""
    from unittest import mock

    from fusedpar import local_params

    _, mesh, groups = _mesh()
    torch.manual_seed(0)
    d, h, tokens = 8, 12, 8
    dense = nn.Sequential(nn.RMSNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
    with torch.no_grad():
        dense[0].weight.uniform_(0.5, 1.5)
    x = _sharded(torch.randn(tokens, d), groups)

    def build():
        norm, up, _, down = copy.deepcopy(dense)
        column = fp.nn.ColumnParallelLinear.from_dense(up, groups["tp"])
        row = fp.nn.RowParallelLinear.from_dense(down, groups["tp"])
        return fp.distribute(nn.Sequential(norm, column, nn.GELU(), row), mesh)

    fast, slow = build(), build()
    # whole tokens (token_axes=()): whole gradients, no reduction, which runs without grad
    plains = {
        model: fp.distribute(copy.deepcopy(nn.Sequential(dense[0], dense[1])), mesh, token_axes=())
        for model in (fast, slow)
    }
    # the reduction's hook only where a gradient from forward is partial: every parameter
    # of the TP model (over cp at least), none of the one of whole tokens
    assert all(p._post_accumulate_grad_hooks for p in fast.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in plains[fast].parameters())
    taken, accumulate = [], local_params._accumulate

    def counted(*args):
        taken.append(accumulate(*args))
        return taken[-1]

    def local_grads(model):  # copies: the next backward accumulates into them
        return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}

    def run(model, accumulate):
        seen = []  # (what, name, detail) in the order the hooks ran
        with mock.patch.object(local_params, "_accumulate", accumulate):
            params = dict(model.named_parameters())

            def loss():
                return model(x).square().sum()

            loss().backward()
            loss().backward()
            grads = {"twice": local_grads(model)}
            model.zero_grad()
            got = torch.autograd.grad(loss(), list(params.values()))
            assert all(p.grad is None for p in params.values())  # returned, not accumulated
            grads["autograd.grad"] = {n: g.to_local() for n, g in zip(params, got, strict=True)}
            loss().backward(inputs=[params["3.weight"]])
            assert [n for n, p in params.items() if p.grad is not None] == ["3.weight"]
            grads["inputs="] = {"3.weight": params["3.weight"].grad.to_local().clone()}
            model.zero_grad()
            params["1.weight"].register_hook(lambda g: g * 3)
            node = params["0.weight"].view_as(params["0.weight"]).grad_fn.next_functions[0][0]
            node.register_hook(lambda *_: seen.append(("node", "0.weight", None)))
            for n, p in params.items():
                p.register_post_accumulate_grad_hook(
                    lambda p, n=n: seen.append(("post", n, p.grad.to_local().sum().item()))
                )
            loss().backward()
            grads["hooked"] = local_grads(model)
            # whole gradients accumulate on the local ones (partial ones were reduced to
            # the parameter's placements: the next is added to that by DTensor, as before)
            plain = plains[model]
            for _ in range(2):
                plain(x).square().sum().backward()
            grads["whole, twice"] = local_grads(plain)
            plain.zero_grad()
            # compiled autograd traces the backward: AccumulateGrad's way, in its graph
            compiled = torch.compile(backend="eager")
            with torch._dynamo.compiled_autograd._enable(compiled):
                plain(x).square().sum().backward()
            grads["compiled autograd"] = local_grads(plain)
            plain.zero_grad()
            # a double backward (the TP layers' ops take none: a plain layer's)
            plain(x).square().sum().backward(create_graph=True)
            seen += [("create_graph", n, p.grad.requires_grad) for n, p in plain.named_parameters()]
            grads["create_graph"] = local_grads(plain)
            for p in params.values():
                assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        return grads, seen

    # a tied parameter (an embedding and its LM head): autograd sums its two gradients,
    # then adds the sum to .grad (G + (a + b), not (G + a) + b): bit for bit
    tied_grads = []
    for way in (counted, lambda *args: False):
        torch.manual_seed(1)
        embed, head = nn.Embedding(11, d), nn.Linear(d, 11, bias=False)
        head.weight = embed.weight
        tied = fp.distribute(nn.ModuleDict({"embed": embed, "head": head}), mesh, token_axes=())
        ids = torch.randint(0, 11, (5,))
        with mock.patch.object(local_params, "_accumulate", way):
            for _ in range(3):
                tied["head"](tied["embed"](ids)).logsumexp(-1).sum().backward()
        tied_grads.append(tied["embed"].weight.grad.to_local())
    assert torch.equal(*tied_grads) and not any(taken)  # AccumulateGrad's way (never asked)
    taken.clear()
    ours, theirs = run(fast, counted), run(slow, lambda *args: False)
    assert ours[1] == theirs[1] and len(ours[1]) == 9, (ours[1], theirs[1])
    assert all(detail for what, _, detail in ours[1] if what == "create_graph")
    for case, want in theirs[0].items():
        for name, grad in want.items():
            assert torch.equal(ours[0][case][name], grad), (case, name)
    # the fast path where AccumulateGrad would run on a gradient of the placements it holds
    assert taken[:5] == [True] * 5 and taken[5:10] == [False] * 5, taken  # twice: reduced
    assert taken[-4:] == [True] * 4, taken  # whole, twice
    return True


def test_accumulating_on_local_tensors_is_autograds_accumulation(world):
    assert all(world(4).run(_run_local_accumulation_is_autograds))
