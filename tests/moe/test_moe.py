"""fp.nn.MoE against a naive float64 loop over tokens and experts, at W = 1, 2 and 4
(the kernels on their own: `tests/moe/test_moe_kernels.py`).

Every rank builds the full router and expert stacks and every rank's tokens from the
seed, runs its share, and checks y, the aux loss and the gradients of x, of its experts
and (summed over ranks, as data parallelism would) of the router. Every output a kernel
allocates starts as NaN (`poisoned_outputs`), so an element it should write and does not,
or a row past the kept pairs that something reads, fails the comparison.
"""

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fusedpar.kernels import moe as moe_kernels
from fusedpar.kernels.moe import grouped_matmul
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.nn.specs import MoESpec
from fusedpar.ops.moe import Experts, moe_reference
from fusedpar.ops.moe_routing import _RouterLogits
from fusedpar.testing import assert_close, exception_of
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds
from tests.moe.helpers import GPT_OSS_KERNEL, SMALL, _kernel_problem, poisoned_outputs

ROOT = Path(__file__).resolve().parents[2]


def _group():
    return dist.group.WORLD if dist.get_world_size() > 1 else None


# The layer's parameters by name: the float64 stacks are built, the references called
# and the gradients compared under these names (the layer's own).
ROUTER, EXPERTS = ("router_weight", "router_bias"), ("w1", "w2", "w3", "b1", "b2", "b3")
SHARED = ("shared_w1", "shared_w2", "shared_w3", "shared_gate_weight")


def _problem(p, size):
    """Full float64 stacks by name, and each rank's tokens and upstream gradient. A
    gpt-oss problem (``p["gpt_oss"]``) adds the router's bias and the experts' biases,
    all random, and scales the gate and up weights 5x so the clamp at 7 bites on some
    elements (`test_the_clamp_bites`); its last expert's router bias is 30 lower, so
    with k < E it gets no token."""
    E, d, h, seed, skew = p["E"], p["d"], p["h"], p["seed"], p["skew"]
    router = randn((E, d), torch.float64, seed)
    router[0] += skew  # with x shifted by skew too, expert 0 draws the tokens
    gate_up = 5.0 if p.get("gpt_oss") else 1.0
    stacks = {
        "router_weight": router,
        "w1": randn((E, h, d), torch.float64, seed + 1) * gate_up / d**0.5,
        "w2": randn((E, d, h), torch.float64, seed + 3) / h**0.5,
        "w3": randn((E, h, d), torch.float64, seed + 2) * gate_up / d**0.5,
    }
    if p["shared"]:  # a shared expert of width h (and its gate)
        stacks.update(
            shared_w1=randn((h, d), torch.float64, seed + 4) / d**0.5,
            shared_w2=randn((d, h), torch.float64, seed + 5) / h**0.5,
            shared_w3=randn((h, d), torch.float64, seed + 6) / d**0.5,
        )
        if p["shared"] == "gated":
            stacks["shared_gate_weight"] = randn((1, d), torch.float64, seed + 7) / d**0.5
    if p.get("gpt_oss"):
        stacks["router_bias"] = randn((E,), torch.float64, seed + 8)  # never zero
        if p["k"] < E:
            stacks["router_bias"][-1] -= 30.0  # an expert no token picks
        for i, (name, n) in enumerate((("b1", h), ("b2", d), ("b3", h))):
            stacks[name] = randn((E, n), torch.float64, seed + 40 + i) * gate_up
    xs = [randn((n, d), torch.float64, seed + 10 + r) + skew for r, n in enumerate(p["tokens"])]
    dys = [randn((n, d), torch.float64, seed + 20 + r) for r, n in enumerate(p["tokens"])]

    def exact(t):  # the oracle sees exactly the values the layer gets
        return t.to(p["dtype"]).double()

    stacks = {name: exact(t) for name, t in stacks.items()}
    return stacks, [exact(x) for x in xs[:size]], [exact(g) for g in dys[:size]]


def _options(p) -> dict:
    """The layer's keywords for the problem's routing and experts."""
    options = dict(
        top_k=p["k"], score=p["score"], capacity_factor=p["capacity"], z_loss_coef=p["z_loss"]
    )
    if p.get("gpt_oss"):
        options["activation"] = "clamped_swiglu"
    return options


def _reference(p, stacks, xs, dys, dtype, batched=False):
    """Naive loop over every rank's tokens: y and aux per rank, grads of the summed loss
    (`batched`: `moe_reference`'s)."""
    params = {n: t.to(dtype, copy=True).requires_grad_() for n, t in stacks.items()}
    xr = [t.to(dtype, copy=True).requires_grad_() for t in xs]
    E, h, d = stacks["w1"].shape
    spec = MoESpec(d, h, E, **_options(p))
    experts = Experts(*(params.get(n) for n in ("w1", "w3", "w2", "b1", "b3", "b2")))
    outs = [
        moe_reference(
            x,
            spec,
            params["router_weight"],
            experts,
            **_extras(params, "reference"),
            batched=batched,
        )
        for x in xr
    ]
    loss = sum((y * dy.to(dtype)).sum() + aux for (y, aux), dy in zip(outs, dys, strict=True))
    if loss.requires_grad:
        loss.backward()

    def grad(t):  # None where no token touched t: its gradient is zero
        return torch.zeros_like(t) if t.grad is None else t.grad

    return outs, [grad(x) for x in xr], {n: grad(t) for n, t in params.items()}


def _worse(ref, routes):
    """Of fp32 routes to one value, the one farther from the float64 `ref`."""
    if ref.numel() == 0:
        return routes[0]
    return max(routes, key=lambda t: (t.double() - ref.double()).abs().max().item())


def _extras(stacks, to="layer") -> dict:
    """The keywords of `MoE.from_dense` (``to="layer"``) or of `moe_reference` for the
    shared expert, its gate and the biases among `stacks` (the reference's expert
    biases: in its `Experts`)."""
    kwargs = {}
    if "shared_w1" in stacks:
        kwargs["shared"] = tuple(stacks[n] for n in SHARED[:3])
    if "shared_gate_weight" in stacks:
        kwargs["shared_gate_weight" if to == "layer" else "shared_gate"] = stacks[SHARED[3]]
    if "b1" in stacks and to == "layer":
        kwargs["bias"] = tuple(stacks[n] for n in ("b1", "b2", "b3"))
    if "router_bias" in stacks:
        kwargs["router_bias"] = stacks["router_bias"]
    return kwargs


def _run_moe(p):
    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = p["dtype"]
    stacks, xs, dys = _problem(p, size)
    stacks_in = {n: t.to(dtype) for n, t in stacks.items()}
    layer = fp.nn.MoE.from_dense(
        *(stacks_in[n] for n in ("router_weight", "w1", "w2", "w3")),
        _group(),
        **_options(p),
        **_extras(stacks_in),
    )
    x = xs[rank].to(dtype).requires_grad_()
    with poisoned_outputs():  # dropped pairs' rows hold NaN: nothing may read them
        y, aux = layer(x)
        ((y * dys[rank].to(dtype)).sum() + aux).backward()

    ref = _reference(p, stacks, xs, dys, torch.float64)
    # PyTorch's own error: the worse of two routes, a token at a time and each expert's
    # projections batched (the attention tests take the worse of two routes alike). With
    # gpt-oss's 5x weights and biases a gate's dot can cancel (terms of +-13 to 0.17),
    # the clamped SwiGLU's slope amplifies its rounding, and one route can be lucky:
    # twice its error then fails an equally valid order (a d b1 once, 5x)
    routes = [_reference(p, stacks, xs, dys, dtype, batched) for batched in (False, True)]
    mine = slice(rank * p["E"] // size, (rank + 1) * p["E"] // size)
    checks = [
        ("y", y, ref[0][rank][0], [s[0][rank][0] for s in routes]),
        (
            "aux",
            aux.reshape(1),
            ref[0][rank][1].reshape(1),
            [s[0][rank][1].reshape(1) for s in routes],
        ),
        ("dx", x.grad, ref[1][rank], [s[1][rank] for s in routes]),
    ]
    for name in stacks:
        grad = getattr(layer, name).grad.clone()
        if name in EXPERTS:  # this rank's experts: every rank's tokens routed to them
            checks.append(
                (f"d {name}", grad, ref[2][name][mine], [s[2][name][mine] for s in routes])
            )
            continue
        if size > 1:  # whole on every rank: the sum data parallelism takes over EP ranks
            dist.all_reduce(grad)
        checks.append((f"d {name}", grad, ref[2][name], [s[2][name] for s in routes]))
    for name, got, r, same in checks:
        assert_close(got, r, _worse(r, same), name=name)
    return float(layer.last_stats["dropped_fraction"])


@st.composite
def moe_problems(draw):
    size = draw(st.sampled_from([1, 2, 4]))
    E = size * draw(st.integers(1, 3))
    return dict(
        world_size=size,
        E=E,
        k=draw(st.integers(1, min(E, 4))),
        d=draw(st.integers(1, 12)),
        h=draw(st.integers(1, 12)),
        tokens=draw(st.lists(st.integers(0, 6), min_size=size, max_size=size)),
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        capacity=draw(st.sampled_from([None, None, 1.0, 0.5])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])),
        skew=draw(st.sampled_from([0.0, 0.5, 2.0])),
        shared=draw(st.sampled_from([None, None, "plain", "gated"])),
        gpt_oss=draw(st.sampled_from([False, False, True])),
        dtype=draw(cpu_dtypes()),
        seed=draw(seeds()),
    )


BASE = dict(
    E=4,
    k=2,
    d=8,
    h=6,
    score="softmax",
    capacity=None,
    z_loss=0.0,
    skew=0.0,
    shared=None,
    gpt_oss=False,
    dtype=torch.float32,
    seed=0,
)
# gpt-oss's experts and router (biases, the clamped SwiGLU) at odd sizes, its last expert
# idle, at EP = 2
GPT_OSS = {**BASE, "world_size": 2, "E": 6, "d": 9, "h": 7, "tokens": [5, 7], "gpt_oss": True}


@given(p=moe_problems())
@example(p={**BASE, "world_size": 2, "tokens": [0, 5]})  # a rank with no tokens
@example(p={**BASE, "world_size": 2, "tokens": [0, 4], "shared": "gated"})  # Qwen2-MoE
@example(p={**BASE, "world_size": 4, "tokens": [3, 0, 0, 2]})  # two of them
@example(p={**BASE, "world_size": 2, "E": 6, "tokens": [1, 1]})  # T = 1, idle experts
@example(p={**BASE, "world_size": 2, "tokens": [6, 6], "skew": 8.0})  # all to expert 0
@example(p={**BASE, "world_size": 1, "E": 3, "k": 3, "tokens": [5]})  # top_k = E
@example(p=GPT_OSS)
# gpt-oss's top-1 at EP 4, three ranks with no tokens: its weight is 1 and gives the
# router no gradient; the renormalized chosen probability gave it rounding amplified by
# 1/p (1.04e-5 off, 6x PyTorch's own fp32 error)
@example(
    p={
        **BASE,
        "world_size": 4,
        "k": 1,
        "d": 9,
        "h": 3,
        "tokens": [0, 0, 0, 4],
        "gpt_oss": True,
        "seed": 147,
    }
)
# ... and at top_k = E, where a softmax over the chosen logits would lose the dominant
# weight's gradient to its own cancellation: the renormalized form is kept for k > 1
@example(
    p={
        **BASE,
        "world_size": 1,
        "E": 2,
        "k": 2,
        "d": 12,
        "h": 1,
        "tokens": [1],
        "skew": 0.5,
        "gpt_oss": True,
        "seed": 3,
    }
)
# a gate's dot cancelling (+-13 to 0.17) under gpt-oss's clamped SwiGLU: the layer's
# rounding is a batched model's, which the token-at-a-time route alone misjudged
@example(
    p={
        **BASE,
        "world_size": 4,
        "E": 8,
        "d": 12,
        "h": 7,
        "tokens": [0, 0, 0, 2],
        "score": "sigmoid",
        "skew": 2.0,
        "gpt_oss": True,
        "seed": 304992189,
    }
)
@example(p={**GPT_OSS, "tokens": [0, 6], "dtype": torch.float16, "capacity": 1.0})
@example(
    p={
        **BASE,
        "world_size": 2,
        "tokens": [6, 4],
        "capacity": 0.5,
        "skew": 2.0,
        "score": "sigmoid",
        "z_loss": 1e-3,
        "dtype": torch.float16,
    }
)  # dropping
def test_moe_matches_naive_loop(world, p):
    p = dict(p)
    size = p.pop("world_size")
    world(size).run(_run_moe, p)


@pytest.mark.parametrize(
    "p",
    [
        {
            **BASE,
            "tokens": [6, 4],
            "capacity": 0.5,
            "skew": 2.0,
            "score": "sigmoid",
            "z_loss": 1e-3,
            "dtype": torch.float16,
        },
        {k: v for k, v in GPT_OSS.items() if k != "world_size"},
    ],
    ids=["dropping", "gpt-oss"],
)
def test_the_layer_on_triton_kernels(world, triton_kernels, p):
    """The property test's dropping and gpt-oss examples with fusedpar's Triton kernels
    (the interpreter here) on both ranks: the kernels inside the layer, not alone."""
    world(2).run(_run_moe, p)


def test_the_clamp_bites():
    """The gpt-oss problems' gate and up values cross the clamp's limits (7): some g
    above, some u beyond either side, so its gradient's zeros are tested."""
    stacks, xs, _ = _problem({k: v for k, v in GPT_OSS.items() if k != "world_size"}, 2)
    x = torch.cat(xs)
    g = torch.einsum("ehd,td->teh", stacks["w1"], x) + stacks["b1"]
    u = torch.einsum("ehd,td->teh", stacks["w3"], x) + stacks["b3"]
    assert (g > 7).float().mean() > 0.02 and (g < 7).float().mean() > 0.5
    assert (u > 7).any() and (u < -7).any() and (u.abs() < 7).float().mean() > 0.5
    q = _kernel_problem({**SMALL, **GPT_OSS_KERNEL}, torch.device("cpu"))
    b1 = q["b1"].repeat_interleave(q["counts"], 0, output_size=q["kept"])
    g = grouped_matmul(q["x"], q["w1"], q["counts"], q["rows"])[: q["kept"]] + b1
    assert (g > 7).any() and (g < 7).float().mean() > 0.5


def _run_determinism(p):
    stacks, xs, dys = _problem(p, dist.get_world_size())
    stacks = {n: t.float() for n, t in stacks.items()}
    layer = fp.nn.MoE.from_dense(
        *(stacks[n] for n in ("router_weight", "w1", "w2", "w3")),
        _group(),
        **_options(p),
        **_extras(stacks),
    )
    results = []
    for _ in range(2):
        layer.zero_grad()
        x = xs[dist.get_rank()].float().requires_grad_()
        y, aux = layer(x)
        ((y * dys[dist.get_rank()].float()).sum() + aux).backward()
        results.append([y, x.grad] + [q.grad.clone() for q in layer.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("world_size, gpt_oss", [(1, False), (2, False), (2, True)])
def test_two_runs_are_bitwise_equal(world, world_size, gpt_oss):
    p = {**BASE, "tokens": [7] * world_size, "skew": 0.5, "gpt_oss": gpt_oss}
    assert all(world(world_size).run(_run_determinism, p))


def _run_capacity_stats():
    torch.manual_seed(0)
    layer = fp.nn.MoE(8, 4, 4, 2, _group(), capacity_factor=0.5)
    x = torch.randn(10, 8) + 3.0  # a skewed batch: some experts are over capacity
    layer(x)
    stats = layer.last_stats
    capacity = 3  # ceil(0.5 * 10 * 2 / 4)
    kept = stats["tokens_per_expert"]
    return (
        bool((kept <= capacity).all())
        and abs(float(stats["dropped_fraction"]) - (20 - int(kept.sum())) / 20) < 1e-6
    )


def test_capacity_caps_experts_and_reports_drops(world):
    assert all(world(2).run(_run_capacity_stats))


def _run_bad(case):
    if case == "experts":
        fp.nn.MoE(8, 4, 3, 1, _group())
    elif case == "top_k":
        fp.nn.MoE(8, 4, 4, 5, _group())
    elif case == "shape":
        fp.nn.MoE(8, 4, 4, 2, _group())(torch.ones(3, 7))
    elif case == "dtype":
        fp.nn.MoE(8, 4, 4, 2, _group())(torch.ones(3, 8, dtype=torch.float16))


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("experts", ValueError, r"num_experts \(3\).*EP group size \(2\)"),
        ("top_k", ValueError, r"top_k \(5\).*num_experts \(4\)"),
        ("shape", ValueError, r"d_model=8.*\(3, 7\)"),
        ("dtype", TypeError, "float16"),
    ],
)
def test_bad_input_fails_on_every_rank(world, case, error, match):
    for e in world(2).run(exception_of, _run_bad, case):
        assert isinstance(e, error) and re.search(match, str(e)), repr(e)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shared_gate_weight": torch.ones(1, 8)}, r"shared_gate needs a shared expert"),
        (
            {
                "shared": (torch.ones(5, 8), torch.ones(8, 5), torch.ones(5, 8)),
                "shared_gate_weight": torch.ones(1, 8),
                "shared_gate": False,
            },
            r"a shared gate given but this MoE was built with shared_gate=False",
        ),
        (
            {"shared": (torch.ones(5, 8), torch.ones(8, 5), torch.ones(5, 8)), "shared_hidden": 0},
            r"a shared expert given but this MoE was built with shared_hidden=0",
        ),
        (
            {"shared": (torch.ones(5, 8), torch.ones(8, 4), torch.ones(5, 8))},
            r"shared w2 must be \(8, 5\), got \(8, 4\)",
        ),
    ],
)
def test_from_dense_refuses_a_shared_expert_it_would_not_compute(kwargs, match):
    stacks = (torch.ones(4, 8), torch.ones(4, 6, 8), torch.ones(4, 8, 6), torch.ones(4, 6, 8))
    with pytest.raises(ValueError, match=match):
        fp.nn.MoE.from_dense(*stacks, top_k=2, **kwargs)


STACKS = (torch.ones(4, 8), torch.ones(4, 6, 8), torch.ones(4, 8, 6), torch.ones(4, 6, 8))
BIASES = (torch.ones(4, 6), torch.ones(4, 8), torch.ones(4, 6))


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: fp.nn.MoE(8, 6, 4, 2, activation="gelu"),
            r"activation must be one of \('silu', 'clamped_swiglu'\), got 'gelu'",
        ),
        (
            lambda: fp.nn.MoE(8, 6, 4, 2, swiglu_limit=7.0),
            r"swiglu_limit apply to activation='clamped_swiglu' only, got activation='silu'",
        ),
        (
            lambda: fp.nn.MoE(8, 6, 4, 2, activation="clamped_swiglu", swiglu_alpha=float("inf")),
            "swiglu_alpha must be a positive finite number, got inf",
        ),
        (
            lambda: fp.nn.MoE(8, 6, 4, 2, activation="clamped_swiglu", swiglu_limit=-7.0),
            "swiglu_limit must be a positive finite number, got -7.0",
        ),
        (
            lambda: fp.nn.MoE.from_dense(*STACKS, top_k=2, bias=(BIASES[0], BIASES[0], BIASES[2])),
            r"b2 must be \(4, 8\), got \(4, 6\)",
        ),
        (
            lambda: fp.nn.MoE.from_dense(*STACKS, top_k=2, router_bias=torch.ones(8)),
            r"router_bias must be \(4,\), got \(8,\)",
        ),
        (
            lambda: fp.nn.MoE(8, 6, 4, 2).load_dense(*STACKS, bias=BIASES),
            r"expert biases given but this MoE was built with bias=False",
        ),
        (
            lambda: fp.nn.MoE(8, 6, 4, 2, router_bias=True).load_dense(*STACKS),
            r"a router bias missing but this MoE was built with router_bias=True",
        ),
    ],
)
def test_bias_and_activation_options_are_checked(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_biases_train_alone():
    """With the weights frozen the biases get the gradients they get beside them, bit for
    bit (the weight-gradient launches that sum them still run), and no weight gets one."""
    grads = []
    for frozen in (False, True):
        torch.manual_seed(0)
        layer = fp.nn.MoE(8, 6, 4, 2, bias=True, router_bias=True, activation="clamped_swiglu")
        for name in ("router_weight", "w1", "w2", "w3"):
            getattr(layer, name).requires_grad_(not frozen)
        y, aux = layer(torch.randn(9, 8, generator=torch.Generator().manual_seed(1)))
        (y.square().sum() + aux).backward()
        grads.append({n: t.grad for n, t in layer.named_parameters() if t.grad is not None})
    assert sorted(grads[1]) == ["b1", "b2", "b3", "router_bias"]
    assert all(torch.equal(g, grads[0][n]) for n, g in grads[1].items())


def test_gpt_oss_matches_hugging_face():
    """Hugging Face's GptOssMLP (router with bias, experts with biases and the clamped
    SwiGLU, gate and up interleaved in one tensor) against the layer built from its
    tensors: y and every gradient, HF in float64 the oracle, HF in fp32 the same-dtype
    peer. Gate and up weights large enough that the clamp bites."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = gpt_oss.GptOssConfig(
        hidden_size=12, intermediate_size=10, num_local_experts=5, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    hf = gpt_oss.GptOssMLP(config)
    with torch.no_grad():
        for param in hf.parameters():  # HF initializes biases to 0: random, never zero
            param.copy_(torch.randn(param.shape) * 1.5)
    x = torch.randn(2, 7, 12)
    dy = torch.randn(2, 7, 12)

    def grads_of(y, leaves):
        (y * dy.to(y.dtype)).sum().backward()
        return [y] + [t.grad for t in leaves]

    def run_hf(dtype):
        model = copy.deepcopy(hf).to(dtype)
        xs = x.to(dtype).requires_grad_()
        e, r = model.experts, model.router
        leaves = [
            xs,
            r.weight,
            r.bias,
            e.gate_up_proj,
            e.gate_up_proj_bias,
            e.down_proj,
            e.down_proj_bias,
        ]
        return grads_of(model(xs)[0], leaves)

    e = hf.experts
    gate, up = (slice(0, None, 2), slice(1, None, 2))  # HF's interleaving
    layer = fp.nn.MoE.from_dense(
        hf.router.weight,
        e.gate_up_proj[..., gate].transpose(1, 2),
        e.down_proj.transpose(1, 2),
        e.gate_up_proj[..., up].transpose(1, 2),
        top_k=2,
        router_bias=hf.router.bias,
        bias=(e.gate_up_proj_bias[..., gate], e.down_proj_bias, e.gate_up_proj_bias[..., up]),
        activation="clamped_swiglu",
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        aux_loss_coef=0.0,
    )
    xs = x.clone().requires_grad_()
    out = grads_of(layer(xs)[0], [xs, layer.router_weight, layer.router_bias])

    def interleave(g, u):  # ours as HF's fused (E, ..., 2h): gate, up alternating
        return torch.stack([g, u], -1).flatten(-2)

    out += [
        interleave(layer.w1.grad.transpose(1, 2), layer.w3.grad.transpose(1, 2)),
        interleave(layer.b1.grad, layer.b3.grad),
        layer.w2.grad.transpose(1, 2),
        layer.b2.grad,
    ]
    names = [
        "y",
        "dx",
        "d router",
        "d router bias",
        "d gate_up",
        "d gate_up bias",
        "d down",
        "d down bias",
    ]
    for name, got, ref, same in zip(
        names, out, run_hf(torch.float64), run_hf(torch.float32), strict=True
    ):
        assert_close(got, ref, same, name=name)
    g = torch.einsum("btd,ehd->bteh", x, layer.w1.detach()) + layer.b1.detach()
    assert (g > config.swiglu_limit).any(), "the clamp should bite"


def test_gpt_oss_layer_parameters():
    """The biases' shapes, initialization (drawn after the weights: a layer without them
    draws the same weights), from_dense and extra_repr."""
    torch.manual_seed(0)
    plain = fp.nn.MoE(8, 6, 4, 2)
    torch.manual_seed(0)
    oss = fp.nn.MoE(
        8,
        6,
        4,
        2,
        bias=True,
        router_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=1.5,
        swiglu_limit=5.0,
    )
    for name in ("router_weight", "w1", "w2", "w3"):
        assert torch.equal(getattr(plain, name), getattr(oss, name)), name
    shapes = {"router_bias": (4,), "b1": (4, 6), "b2": (4, 8), "b3": (4, 6)}
    for name, shape in shapes.items():
        t = getattr(oss, name)
        assert t.shape == shape and 0 < t.abs().max() <= 1 / 6**0.5, name  # 1/sqrt(fan in)
        assert getattr(plain, name) is None
    assert "bias=True, router_bias=True, activation=clamped_swiglu(alpha=1.5, limit=5.0)" in repr(
        oss
    )
    again = fp.nn.MoE.from_dense(
        *STACKS, top_k=2, bias=BIASES, router_bias=torch.ones(4), activation="clamped_swiglu"
    )
    assert again.b2.shape == (4, 8) and again.router_bias is not None
    assert (again.swiglu_alpha, again.swiglu_limit) == (1.702, 7.0)


def test_leading_dims_and_no_group():
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 2, score="sigmoid", z_loss_coef=1e-3)
    x = torch.randn(2, 3, 6)
    y, aux = layer(x)
    ref, ref_aux = moe_reference(
        x.reshape(-1, 6), layer.spec, layer.router_weight, Experts(layer.w1, layer.w3, layer.w2)
    )
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 6), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref_aux)


def test_inference_matches_training_forward(monkeypatch):
    """Under no_grad the experts skip storing h1 and h3 and give the same bits."""
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 2, capacity_factor=0.5)
    x = torch.randn(9, 6) + 1.0
    y, _ = layer(x)
    saved = []
    real = moe_kernels.grouped_swiglu

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        saved.append(out[1])
        return out

    monkeypatch.setattr(fp.ops.moe, "grouped_swiglu", spy)
    with torch.no_grad():
        y_inference, _ = layer(x)
    assert torch.equal(y, y_inference) and saved == [None]


def test_expert_bias_steers_selection_only():
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 1, score="sigmoid", norm_topk_prob=False)
    x = torch.randn(8, 6)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    layer(x)
    assert layer.last_stats["tokens_per_expert"].tolist() == [0, 0, 0, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_router_logits_are_autograds_bits(dtype):
    """The logits' Function saves x and the router weight as they are, not fp32 copies:
    its logits and both gradients are the bits autograd gives the upcast expression."""
    x, weight = randn((37, 65), dtype, 0), randn((9, 65), dtype, 1)
    d_logits = randn((37, 9), torch.float32, 2)
    outputs = []
    for logits_of in (lambda a, b: a.float() @ b.float().T, _RouterLogits.apply):
        a, b = x.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = logits_of(a, b)
        outputs.append((logits, *torch.autograd.grad(logits, (a, b), d_logits)))
    assert all(torch.equal(p, q) for p, q in zip(*outputs, strict=True))


# --- the benchmark's peers, on CPU -----------------------------------------------------------


def test_bench_peers_match_the_reference(monkeypatch, capsys):
    """bench/moe.py runs on a GPU only, but its peer layers (a per-expert loop and
    torchtitan's torch._grouped_mm recipe) are plain torch: check their forward here."""
    monkeypatch.syspath_prepend(str(ROOT))
    bench_moe = pytest.importorskip("bench.moe")
    torch.manual_seed(0)
    E, d, h, k = 4, 16, 8, 2  # 16-byte aligned rows: torch._grouped_mm's CPU kernel needs it
    router, w1, w3 = torch.randn(E, d), torch.randn(E, h, d) / 4, torch.randn(E, h, d) / 4
    w2 = torch.randn(E, d, h) / 3
    x = torch.randn(13, d)
    experts = Experts(w1.double(), w3.double(), w2.double())
    ref, _ = moe_reference(x.double(), MoESpec(d, h, E, k), router.double(), experts)
    peers = [bench_moe._naive_moe]
    if hasattr(torch, "_grouped_mm"):
        peers.append(bench_moe._grouped_mm_moe)
    for peer in peers:
        torch.testing.assert_close(
            peer(x, router, w1, w2, w3, k).double(), ref, rtol=1e-5, atol=1e-5
        )
    ids = bench_moe._routing(8, True, torch.Generator().manual_seed(0), 32, 4, "cpu")
    assert ids.shape == (32, 4) and all(len(set(r)) == 4 for r in ids.tolist())
    if not torch.cuda.is_available():
        bench_moe.main()  # says why and returns: no GPU here
        assert "no CUDA device" in capsys.readouterr().out
