"""fp.nn.MoE against a naive float64 loop over tokens and experts, at W = 1, 2 and 4, and
each MoE kernel against its plain-PyTorch reference.

Every rank builds the full router and expert stacks and every rank's tokens from the
seed, runs its share, and checks y, the aux loss and the gradients of x, of its experts
and (summed over ranks, as data parallelism would) of the router. Every output a kernel
allocates starts as NaN (`poisoned_outputs`), so an element it should write and does not,
or a row past the kept pairs that something reads, fails the comparison.

The kernel checks (`KERNEL_CHECKS`) are plain functions of a problem dict and a device:
the CPU tier runs them on hypothesis-drawn tiny fp32/fp16 problems in the interpreter,
the GPU tier (``pytest -m gpu``) on realistic bf16/fp16 shapes.
"""

import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import triton
from fusedpar.kernels import _tuning, moe_permute, moe_weight_grad
from fusedpar.kernels import moe as moe_kernels
from fusedpar.kernels.moe import (
    expert_swiglu_reference,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_swiglu,
    grouped_swiglu_backward,
    grouped_swiglu_input_grad,
)
from fusedpar.kernels.moe_permute import (
    combine,
    combine_reference,
    combine_weight_grad,
    dispatch_metadata,
    gather_rows,
)
from fusedpar.kernels.moe_weight_grad import (
    expert_sums_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from hypothesis import example, given
from hypothesis import strategies as st

import fusedpar as fp
from fusedpar.ops.moe import expert_swiglu, moe_reference
from fusedpar.testing import assert_close, exception_of
from fusedpar.testing.strategies import cpu_dtypes, randn, seeds

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def poisoned_outputs():
    """Every output the MoE kernels' launchers allocate starts as NaN while inside."""
    modules = (moe_kernels, moe_permute, moe_weight_grad)
    real = [module._empty for module in modules]

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    for module in modules:
        module._empty = nan_empty
    try:
        yield
    finally:
        for module, empty in zip(modules, real, strict=True):
            module._empty = empty


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
    stacks = {"router_weight": router,
              "w1": randn((E, h, d), torch.float64, seed + 1) * gate_up / d**0.5,
              "w2": randn((E, d, h), torch.float64, seed + 3) / h**0.5,
              "w3": randn((E, h, d), torch.float64, seed + 2) * gate_up / d**0.5}  # fmt: skip
    if p["shared"]:  # a shared expert of width h (and its gate)
        stacks.update(shared_w1=randn((h, d), torch.float64, seed + 4) / d**0.5,
                      shared_w2=randn((d, h), torch.float64, seed + 5) / h**0.5,
                      shared_w3=randn((h, d), torch.float64, seed + 6) / d**0.5)  # fmt: skip
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
    options = dict(top_k=p["k"], score=p["score"], capacity_factor=p["capacity"],
                   z_loss_coef=p["z_loss"])  # fmt: skip
    if p.get("gpt_oss"):
        options["activation"] = "clamped_swiglu"
    return options


def _reference(p, stacks, xs, dys, dtype, batched=False):
    """Naive loop over every rank's tokens: y and aux per rank, grads of the summed loss
    (`batched`: `moe_reference`'s)."""
    params = {n: t.to(dtype, copy=True).requires_grad_() for n, t in stacks.items()}
    xr = [t.to(dtype, copy=True).requires_grad_() for t in xs]
    kwargs = _options(p)
    if "activation" in kwargs:
        kwargs["swiglu_alpha"], kwargs["swiglu_limit"] = 1.702, 7.0
    outs = [moe_reference(x, *(params[n] for n in ("router_weight", "w1", "w2", "w3")),
                          **kwargs, **_extras(params, "reference"), batched=batched)
            for x in xr]  # fmt: skip
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
    shared expert, its gate and the biases among `stacks`."""
    kwargs = {}
    if "shared_w1" in stacks:
        kwargs["shared"] = tuple(stacks[n] for n in SHARED[:3])
    if "shared_gate_weight" in stacks:
        kwargs["shared_gate_weight" if to == "layer" else "shared_gate"] = stacks[SHARED[3]]
    if "b1" in stacks:
        kwargs["bias"] = tuple(stacks[n] for n in ("b1", "b2", "b3"))
    if "router_bias" in stacks:
        kwargs["router_bias"] = stacks["router_bias"]
    return kwargs


def _run_moe(p):
    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = p["dtype"]
    stacks, xs, dys = _problem(p, size)
    stacks_in = {n: t.to(dtype) for n, t in stacks.items()}
    layer = fp.nn.MoE.from_dense(*(stacks_in[n] for n in ("router_weight", "w1", "w2", "w3")),
                                 _group(), **_options(p), **_extras(stacks_in))  # fmt: skip
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
        ("aux", aux.reshape(1), ref[0][rank][1].reshape(1),
         [s[0][rank][1].reshape(1) for s in routes]),
        ("dx", x.grad, ref[1][rank], [s[1][rank] for s in routes]),
    ]  # fmt: skip
    for name in stacks:
        grad = getattr(layer, name).grad.clone()
        if name in EXPERTS:  # this rank's experts: every rank's tokens routed to them
            checks.append((f"d {name}", grad, ref[2][name][mine],
                           [s[2][name][mine] for s in routes]))  # fmt: skip
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
        world_size=size, E=E, k=draw(st.integers(1, min(E, 4))),
        d=draw(st.integers(1, 12)), h=draw(st.integers(1, 12)),
        tokens=draw(st.lists(st.integers(0, 6), min_size=size, max_size=size)),
        score=draw(st.sampled_from(["softmax", "sigmoid"])),
        capacity=draw(st.sampled_from([None, None, 1.0, 0.5])),
        z_loss=draw(st.sampled_from([0.0, 1e-3])), skew=draw(st.sampled_from([0.0, 0.5, 2.0])),
        shared=draw(st.sampled_from([None, None, "plain", "gated"])),
        gpt_oss=draw(st.sampled_from([False, False, True])),
        dtype=draw(cpu_dtypes()), seed=draw(seeds()),
    )  # fmt: skip


BASE = dict(E=4, k=2, d=8, h=6, score="softmax", capacity=None, z_loss=0.0, skew=0.0,
            shared=None, gpt_oss=False, dtype=torch.float32, seed=0)  # fmt: skip
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
@example(p={**BASE, "world_size": 4, "k": 1, "d": 9, "h": 3, "tokens": [0, 0, 0, 4],
            "gpt_oss": True, "seed": 147})  # fmt: skip
# ... and at top_k = E, where a softmax over the chosen logits would lose the dominant
# weight's gradient to its own cancellation: the renormalized form is kept for k > 1
@example(p={**BASE, "world_size": 1, "E": 2, "k": 2, "d": 12, "h": 1, "tokens": [1],
            "skew": 0.5, "gpt_oss": True, "seed": 3})  # fmt: skip
# a gate's dot cancelling (+-13 to 0.17) under gpt-oss's clamped SwiGLU: the layer's
# rounding is a batched model's, which the token-at-a-time route alone misjudged
@example(p={**BASE, "world_size": 4, "E": 8, "d": 12, "h": 7, "tokens": [0, 0, 0, 2],
            "score": "sigmoid", "skew": 2.0, "gpt_oss": True, "seed": 304992189})  # fmt: skip
@example(p={**GPT_OSS, "tokens": [0, 6], "dtype": torch.float16, "capacity": 1.0})
@example(p={**BASE, "world_size": 2, "tokens": [6, 4], "capacity": 0.5, "skew": 2.0,
            "score": "sigmoid", "z_loss": 1e-3, "dtype": torch.float16})  # dropping  # fmt: skip
def test_moe_matches_naive_loop(world, p):
    p = dict(p)
    size = p.pop("world_size")
    world(size).run(_run_moe, p)


@pytest.mark.parametrize("p", [
    {**BASE, "tokens": [6, 4], "capacity": 0.5, "skew": 2.0, "score": "sigmoid",
     "z_loss": 1e-3, "dtype": torch.float16},
    {k: v for k, v in GPT_OSS.items() if k != "world_size"},
], ids=["dropping", "gpt-oss"])  # fmt: skip
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
    layer = fp.nn.MoE.from_dense(*(stacks[n] for n in ("router_weight", "w1", "w2", "w3")),
                                 _group(), **_options(p), **_extras(stacks))  # fmt: skip
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
    [("experts", ValueError, r"num_experts \(3\).*EP group size \(2\)"),
     ("top_k", ValueError, r"top_k \(5\).*num_experts \(4\)"),
     ("shape", ValueError, r"d_model=8.*\(3, 7\)"), ("dtype", TypeError, "float16")],
)  # fmt: skip
def test_bad_input_fails_on_every_rank(world, case, error, match):
    for e in world(2).run(exception_of, _run_bad, case):
        assert isinstance(e, error) and re.search(match, str(e)), repr(e)


@pytest.mark.parametrize("kwargs, match", [
    ({"shared_gate_weight": torch.ones(1, 8)}, r"shared_gate needs a shared expert"),
    ({"shared": (torch.ones(5, 8), torch.ones(8, 5), torch.ones(5, 8)),
      "shared_gate_weight": torch.ones(1, 8), "shared_gate": False},
     r"a shared gate given but this MoE was built with shared_gate=False"),
    ({"shared": (torch.ones(5, 8), torch.ones(8, 5), torch.ones(5, 8)), "shared_hidden": 0},
     r"a shared expert given but this MoE was built with shared_hidden=0"),
    ({"shared": (torch.ones(5, 8), torch.ones(8, 4), torch.ones(5, 8))},
     r"shared w2 must be \(8, 5\), got \(8, 4\)"),
])  # fmt: skip
def test_from_dense_refuses_a_shared_expert_it_would_not_compute(kwargs, match):
    stacks = (torch.ones(4, 8), torch.ones(4, 6, 8), torch.ones(4, 8, 6), torch.ones(4, 6, 8))
    with pytest.raises(ValueError, match=match):
        fp.nn.MoE.from_dense(*stacks, top_k=2, **kwargs)


STACKS = (torch.ones(4, 8), torch.ones(4, 6, 8), torch.ones(4, 8, 6), torch.ones(4, 6, 8))
BIASES = (torch.ones(4, 6), torch.ones(4, 8), torch.ones(4, 6))


@pytest.mark.parametrize("build, match", [
    (lambda: fp.nn.MoE(8, 6, 4, 2, activation="gelu"),
     r"activation must be one of \('silu', 'clamped_swiglu'\), got 'gelu'"),
    (lambda: fp.nn.MoE(8, 6, 4, 2, swiglu_limit=7.0),
     r"swiglu_limit apply to activation='clamped_swiglu' only, got activation='silu'"),
    (lambda: fp.nn.MoE(8, 6, 4, 2, activation="clamped_swiglu", swiglu_alpha=float("inf")),
     "swiglu_alpha must be a positive finite number, got inf"),
    (lambda: fp.nn.MoE(8, 6, 4, 2, activation="clamped_swiglu", swiglu_limit=-7.0),
     "swiglu_limit must be a positive finite number, got -7.0"),
    (lambda: fp.nn.MoE.from_dense(*STACKS, top_k=2, bias=(BIASES[0], BIASES[0], BIASES[2])),
     r"b2 must be \(4, 8\), got \(4, 6\)"),
    (lambda: fp.nn.MoE.from_dense(*STACKS, top_k=2, router_bias=torch.ones(8)),
     r"router_bias must be \(4,\), got \(8,\)"),
    (lambda: fp.nn.MoE(8, 6, 4, 2).load_dense(*STACKS, bias=BIASES),
     r"expert biases given but this MoE was built with bias=False"),
    (lambda: fp.nn.MoE(8, 6, 4, 2, router_bias=True).load_dense(*STACKS),
     r"a router bias missing but this MoE was built with router_bias=True"),
])  # fmt: skip
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
    config = gpt_oss.GptOssConfig(hidden_size=12, intermediate_size=10, num_local_experts=5,
                                  num_experts_per_tok=2)  # fmt: skip
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
        leaves = [xs, r.weight, r.bias, e.gate_up_proj, e.gate_up_proj_bias, e.down_proj,
                  e.down_proj_bias]  # fmt: skip
        return grads_of(model(xs)[0], leaves)

    e = hf.experts
    gate, up = (slice(0, None, 2), slice(1, None, 2))  # HF's interleaving
    layer = fp.nn.MoE.from_dense(
        hf.router.weight, e.gate_up_proj[..., gate].transpose(1, 2), e.down_proj.transpose(1, 2),
        e.gate_up_proj[..., up].transpose(1, 2), top_k=2, router_bias=hf.router.bias,
        bias=(e.gate_up_proj_bias[..., gate], e.down_proj_bias, e.gate_up_proj_bias[..., up]),
        activation="clamped_swiglu", swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit, aux_loss_coef=0.0,
    )  # fmt: skip
    xs = x.clone().requires_grad_()
    out = grads_of(layer(xs)[0], [xs, layer.router_weight, layer.router_bias])

    def interleave(g, u):  # ours as HF's fused (E, ..., 2h): gate, up alternating
        return torch.stack([g, u], -1).flatten(-2)

    out += [interleave(layer.w1.grad.transpose(1, 2), layer.w3.grad.transpose(1, 2)),
            interleave(layer.b1.grad, layer.b3.grad), layer.w2.grad.transpose(1, 2),
            layer.b2.grad]  # fmt: skip
    names = ["y", "dx", "d router", "d router bias", "d gate_up", "d gate_up bias", "d down",
             "d down bias"]  # fmt: skip
    for name, got, ref, same in zip(names, out, run_hf(torch.float64), run_hf(torch.float32),
                                    strict=True):  # fmt: skip
        assert_close(got, ref, same, name=name)
    g = torch.einsum("btd,ehd->bteh", x, layer.w1.detach()) + layer.b1.detach()
    assert (g > config.swiglu_limit).any(), "the clamp should bite"


def test_gpt_oss_layer_parameters():
    """The biases' shapes, initialization (drawn after the weights: a layer without them
    draws the same weights), from_dense and extra_repr."""
    torch.manual_seed(0)
    plain = fp.nn.MoE(8, 6, 4, 2)
    torch.manual_seed(0)
    oss = fp.nn.MoE(8, 6, 4, 2, bias=True, router_bias=True, activation="clamped_swiglu",
                    swiglu_alpha=1.5, swiglu_limit=5.0)  # fmt: skip
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
    again = fp.nn.MoE.from_dense(*STACKS, top_k=2, bias=BIASES, router_bias=torch.ones(4),
                                 activation="clamped_swiglu")  # fmt: skip
    assert again.b2.shape == (4, 8) and again.router_bias is not None
    assert (again.swiglu_alpha, again.swiglu_limit) == (1.702, 7.0)


def test_leading_dims_and_no_group():
    torch.manual_seed(0)
    layer = fp.nn.MoE(6, 5, 4, 2, score="sigmoid", z_loss_coef=1e-3)
    x = torch.randn(2, 3, 6)
    y, aux = layer(x)
    ref, ref_aux = moe_reference(x.reshape(-1, 6), layer.router_weight, layer.w1, layer.w2,
                                 layer.w3, top_k=2, score="sigmoid", z_loss_coef=1e-3)  # fmt: skip
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


# --- the kernels on their own: checks shared by the CPU and GPU tiers ----------------------


def _operand(shape, dtype, seed, device, strided, scale=1.0):
    """Random data; `strided`: a transposed view of the last two dims (no unit stride
    where a contiguous tensor has one)."""
    if not strided:
        return randn(shape, dtype, seed, scale=scale).to(device)
    flipped = (*shape[:-2], shape[-1], shape[-2])
    return randn(flipped, dtype, seed, scale=scale).to(device).transpose(-1, -2)


def _kernel_problem(p, device):
    """Routing of T tokens to k of E experts (skewed popularity, `empty` experts never
    chosen, a random `drop` mask) and the operands of the experts' SwiGLU: with
    ``p["bias"]`` random biases (b1, b2, b3), with ``p["act"] == "clamped_swiglu"``
    gate and up weights and biases 5x larger, so the clamp at 7 bites."""
    T, k, E, d, h, dtype, seed = (p[n] for n in ("T", "k", "E", "d", "h", "dtype", "seed"))
    gen = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** p["skew"]
    popularity[E - p["empty"] :] = 0.0  # the last `empty` experts get no pair
    ids = torch.multinomial(popularity, max(T * k, 1), replacement=True, generator=gen)
    ids = ids[: T * k].view(T, k)
    keep = torch.rand(T, k, generator=gen) > 0.3 if p["drop"] else None
    counts, order, pos = dispatch_metadata(
        ids.to(device), E, None if keep is None else keep.to(device)
    )
    strided, act = p["strided"], p.get("act", "silu")
    big = 5.0 if act == "clamped_swiglu" else 1.0
    biases = [_operand((E, n), dtype, seed + 7 + i, device, strided, scale)
              for i, (n, scale) in enumerate(((h, big), (d, 1.0), (h, big)))]  # fmt: skip
    return dict(
        counts=counts, order=order, pos=pos, rows=order // k, kept=int(counts.sum()),
        x=_operand((T, d), dtype, seed + 1, device, strided),
        w1=_operand((E, h, d), dtype, seed + 2, device, strided, big * d**-0.5),
        w3=_operand((E, h, d), dtype, seed + 3, device, strided, big * d**-0.5),
        w2=_operand((E, d, h), dtype, seed + 4, device, strided, h**-0.5),
        dy=_operand((T * k, d), dtype, seed + 5, device, strided),
        dh13=_operand((T * k, 2 * h), dtype, seed + 6, device, strided),
        b1=biases[0], b2=biases[1], b3=biases[2],
        bias=tuple(biases) if p.get("bias") else None, act={"activation": act},
    )  # fmt: skip


def _unwritten(t, kept, name):
    """Rows past the kept pairs stay as poisoned: no kernel writes there."""
    assert t[kept:].isnan().all(), f"{name}: a row past the kept pairs was written"


def check_grouped_matmul(p, device):
    """grouped_matmul gathering from x, and on rows already in expert order with the
    weight read transposed (the backward's use)."""
    q = _kernel_problem(p, device)
    x, w, counts, rows, n = q["x"], q["w1"], q["counts"], q["rows"], q["kept"]
    b = None if q["bias"] is None else q["b1"]
    with poisoned_outputs():
        y = grouped_matmul(x, w, counts, rows, bias=b)
        dx = grouped_matmul(q["dy"], q["w2"], counts, transpose_w=True)
    _unwritten(y, n, "gathered y")
    b64 = None if b is None else b.double()
    ref = grouped_matmul_reference(x.double(), w.double(), counts, rows, bias=b64)
    same = grouped_matmul_reference(x, w, counts, rows, bias=b)
    assert_close(y[:n], ref, same, name="gathered y")
    args = (q["dy"], q["w2"], counts, None, True)
    ref = grouped_matmul_reference(*(t.double() for t in args[:2]), *args[2:])
    assert_close(dx[:n], ref, grouped_matmul_reference(*args), name="transposed w")


def check_expert_swiglu(p, device):
    """The fused gate/up kernel, then `expert_swiglu` forward and every gradient against
    the loop over experts; the backward's recomputed a equals the forward's bit for bit."""
    q = _kernel_problem(p, device)
    counts, rows, pos, n, act = q["counts"], q["rows"], q["pos"], q["kept"], q["act"]
    b13 = None if q["bias"] is None else (q["b1"], q["b3"])
    with poisoned_outputs():
        a, h13 = grouped_swiglu(q["x"], q["w1"], q["w3"], counts, rows, bias=b13, **act)
        _, a_again = grouped_swiglu_backward(q["dy"], q["w2"], h13, counts, **act)
    for t, name in ((a, "a"), (h13, "h13"), (a_again, "a again")):
        _unwritten(t, n, name)
    assert torch.equal(a[:n], a_again[:n]), "the backward's a differs from the forward's"

    def run(operands, fused):
        x, w1, w3, w2, *bias = (t.detach().requires_grad_() for t in operands)
        bias = tuple(bias) or None  # (b1, b2, b3)
        if fused:
            with poisoned_outputs():
                out = expert_swiglu(x, w1, w3, w2, counts, rows, pos, bias=bias, **act)
                _unwritten(out, n, "expert outputs")
                (out[:n] * q["dy"][:n]).sum().backward()
            out = out[:n]
        else:
            out = expert_swiglu_reference(x, w1, w3, w2, counts, rows, bias=bias, **act)
            if out.requires_grad:
                (out * q["dy"][:n].to(out.dtype)).sum().backward()
        leaves = (x, w1, w3, w2, *(bias or ()))
        return [out, *(torch.zeros_like(t) if t.grad is None else t.grad for t in leaves)]

    names = ["x", "w1", "w3", "w2"] + (["b1", "b2", "b3"] if q["bias"] else [])
    operands = [q[n_] for n_ in names]
    got = run(operands, True)
    ref = run([t.double() for t in operands], False)
    same = run(operands, False)
    for name, g, r, t in zip(["out"] + [f"d{n_}" for n_ in names], got, ref, same, strict=True):
        assert_close(g, r, t, name=name)


def test_the_clamp_passes_the_gradient_on_its_bounds(each_implementation):
    """torch.clamp's convention, which both implementations follow: where h1 = 7 or
    h3 = -7 or 7 exactly, the gradient passes (integer data, and biases that put one
    token's value of each column on a bound, exactly)."""
    gen = torch.Generator().manual_seed(0)
    T, E, d, h = 12, 2, 3, 8

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=gen).double()

    x, w1, w3 = ints(T, d), ints(E, h, d), ints(E, h, d)
    w2, dy = torch.randn(E, d, h, generator=gen, dtype=torch.float64), ints(T, d)
    counts, order, pos = dispatch_metadata(torch.arange(T).view(T, 1) % E, E)
    b1, b3, b2 = ints(E, h), ints(E, h), ints(E, d)
    for e in range(E):
        for j in range(h):  # token e's h1 on the upper bound, token e + E's h3 on one
            b1[e, j] = 7.0 - x[e] @ w1[e, j]
            b3[e, j] = (7.0 if j % 2 else -7.0) - x[e + E] @ w3[e, j]
    h1 = torch.einsum("td,ehd->teh", x, w1) + b1
    h3 = torch.einsum("td,ehd->teh", x, w3) + b3
    assert (h1 == 7).sum() >= E * h and (h3 == 7).any() and (h3 == -7).any()
    operands = [x, w1, w3, w2, b1, b2, b3]

    def run(operands, fused):
        x, w1, w3, w2, *bias = (t.detach().requires_grad_() for t in operands)
        fn = expert_swiglu if fused else expert_swiglu_reference
        extra = (pos,) if fused else ()
        out = fn(x, w1, w3, w2, counts, order, *extra, bias=tuple(bias),
                 activation="clamped_swiglu")  # fmt: skip
        (out * dy[order].to(out.dtype)).sum().backward()
        return [out] + [t.grad for t in (x, w1, w3, w2, *bias)]

    got = run([t.float() for t in operands], True)
    ref = run(operands, False)
    same = run([t.float() for t in operands], False)
    names = ["out", "dx", "dw1", "dw3", "dw2", "db1", "db2", "db3"]
    for name, g, r, t in zip(names, got, ref, same, strict=True):
        assert_close(g, r, t, name=name)


def check_weight_grad(p, device):
    """grouped_weight_grad gathering x (both halves of a split dy) and on rows in order."""
    q = _kernel_problem(p, device)
    x, counts, rows, dh, h = q["x"], q["counts"], q["rows"], q["dh13"], p["h"]
    bias = q["bias"] is not None  # the bias gradients too, from the same launches
    with poisoned_outputs():
        dw1, dw3, *db13 = grouped_weight_grad(dh, x, counts, rows, split=True, bias_grad=bias)
        dw2 = grouped_weight_grad(q["dy"], dh[:, :h], counts, bias_grad=bias)
    dw2, *db2 = dw2 if bias else (dw2,)
    cases = [("dw1", dw1, dh[:, :h], x, rows), ("dw3", dw3, dh[:, h:], x, rows),
             ("dw2", dw2, q["dy"], dh[:, :h], None)]  # fmt: skip
    for name, got, dy, src, r in cases:
        ref = grouped_weight_grad_reference(dy.double(), src.double(), counts, r)
        assert_close(got, ref, grouped_weight_grad_reference(dy, src, counts, r), name=name)
        assert (got[counts == 0] == 0).all(), f"{name}: an empty expert's gradient is not 0"
    for (name, _, dy, _, _), got in zip(cases, [*db13, *db2], strict=False):
        name = "db" + name[2:]
        ref = expert_sums_reference(dy.double(), counts)
        assert_close(got, ref, expert_sums_reference(dy, counts), name=name)
        assert (got[counts == 0] == 0).all(), f"{name}: an empty expert's gradient is not 0"


def check_permute_combine(p, device):
    """gather_rows (plain and scaled), combine (weighted, dropped slots skipped) and the
    combine's weight gradient."""
    q = _kernel_problem(p, device)
    x, rows, pos, dy = q["x"], q["rows"], q["pos"], q["dy"]
    T, k = pos.shape
    weight = torch.rand(T, k, generator=torch.Generator().manual_seed(p["seed"])).to(device)
    scale = weight.reshape(-1)[q["order"]]
    with poisoned_outputs():
        permuted = gather_rows(x, rows)
        scaled = gather_rows(x, rows, scale)
        y = combine(dy, pos, weight)
        dw = combine_weight_grad(y, dy, pos)
    assert torch.equal(permuted, x[rows]), "gather_rows must copy rows exactly"
    ref = x.double()[rows] * scale.double()[:, None]
    assert_close(scaled, ref, (x[rows].float() * scale[:, None]).to(x.dtype), name="scaled")
    ref = combine_reference(dy.double(), pos, weight.double())
    assert_close(y, ref, combine_reference(dy, pos, weight), name="combine")

    def dw_reference(yy, src):
        live = pos >= 0
        return (yy[:, None, :] * src[pos.clamp(min=0)]).sum(-1) * live

    ref = dw_reference(y.double(), dy.double())
    assert_close(dw, ref, dw_reference(y.float(), dy.float()), name="combine weight grad")


KERNEL_CHECKS = [check_grouped_matmul, check_expert_swiglu, check_weight_grad,
                 check_permute_combine]  # fmt: skip


@st.composite
def kernel_problems(draw):
    E = draw(st.integers(1, 5))
    return dict(
        T=draw(st.integers(0, 24)), k=draw(st.integers(1, 3)), E=E, d=draw(st.integers(1, 40)),
        h=draw(st.integers(1, 40)), empty=draw(st.integers(0, E - 1)),
        skew=draw(st.sampled_from([0.0, 1.0, 3.0])), drop=draw(st.booleans()),
        strided=draw(st.booleans()), bias=draw(st.booleans()),
        act=draw(st.sampled_from(["silu", "clamped_swiglu"])), dtype=draw(cpu_dtypes()),
        seed=draw(seeds()),
    )  # fmt: skip


SMALL = dict(T=9, k=2, E=4, d=10, h=7, empty=1, skew=1.0, drop=True, strided=False,
             dtype=torch.float32, seed=0)  # fmt: skip
# gpt-oss's experts: biases and the clamped SwiGLU, strided, an empty expert, drops
GPT_OSS_KERNEL = dict(T=20, bias=True, act="clamped_swiglu", strided=True)


@pytest.mark.parametrize("check", KERNEL_CHECKS, ids=lambda c: c.__name__[6:])
@given(p=kernel_problems())
@example(p={**SMALL, "T": 0})  # no token
@example(p={**SMALL, "d": 70, "h": 67, "strided": True, "dtype": torch.float16})  # loops over D, K
@example(p={**SMALL, "T": 40, "k": 1, "E": 2, "empty": 0, "drop": False})  # many blocks/expert
@example(p={**SMALL, **GPT_OSS_KERNEL})
@example(p={**SMALL, **GPT_OSS_KERNEL, "dtype": torch.float16, "d": 70, "h": 67})
@example(p={**SMALL, "T": 1, "k": 2, "E": 1, "d": 1, "h": 1, "empty": 0, "drop": True,
            "seed": 230})  # a dropped slot: its unwritten (poisoned) row is never read  # fmt: skip
def test_kernels_match_references(check, p, each_implementation):
    check(p, torch.device("cpu"))


GPU_PROBLEMS = {
    # fine-grained experts, top-8, 4 of 64 experts empty
    "E64-d2048": dict(T=2048, k=8, E=64, d=2048, h=768, empty=4, skew=1.0, drop=False,
                      strided=False),
    # few large experts, a capacity drop, strided operands, h not a multiple of 64
    "E8-d512-drop": dict(T=3000, k=2, E=8, d=512, h=1400, empty=1, skew=1.0, drop=True,
                         strided=True),
    # d past one permute tile (2048): the D loop; uneven experts
    "E16-d2560": dict(T=1000, k=4, E=16, d=2560, h=1000, empty=2, skew=2.0, drop=False,
                      strided=False),
    # gpt-oss-20b's experts: biases, the clamped SwiGLU, d = h = 2880 (not a multiple of 64)
    "E32-gpt-oss": dict(T=1024, k=4, E=32, d=2880, h=2880, empty=2, skew=1.0, drop=False,
                        strided=False, bias=True, act="clamped_swiglu"),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("problem", list(GPU_PROBLEMS))
@pytest.mark.parametrize("check", KERNEL_CHECKS, ids=lambda c: c.__name__[6:])
def test_kernels_match_references_gpu(check, problem, dtype, each_implementation):
    check({**GPU_PROBLEMS[problem], "dtype": dtype, "seed": 0}, torch.device("cuda"))


def check_tile_independence(p, device, gemm_configs, wgrad_configs, exact=False):
    """Every config sums in the same order (one BLOCK_K, one row step for the weight
    gradient), so forcing each in turn must give the same bits. `exact`: integer-valued
    operands, whose sums are exact in any order (the interpreter's numpy dot orders its
    sums by tile shape, so on CPU only the forcing and the per-config grids are tested)."""
    q = _kernel_problem(p, device)
    if exact:
        q.update({n_: (q[n_] * 2).round() for n_ in ("x", "w1", "dh13")})
    x, counts, rows, n = q["x"], q["counts"], q["rows"], q["kept"]

    def gemm():
        return grouped_matmul(x, q["w1"], counts, rows)[:n]

    def wgrad():  # dw1, dw3 and the biases' db1, db3
        grads = grouped_weight_grad(q["dh13"], x, counts, rows, split=True, bias_grad=True)
        return torch.cat([t.flatten() for t in grads])

    real = moe_kernels._gemm_candidates, moe_weight_grad._weight_grad_candidates
    try:
        for module, name, configs, run in (
            (moe_kernels, "_gemm_candidates", gemm_configs, gemm),
            (moe_weight_grad, "_weight_grad_candidates", wgrad_configs, wgrad),
        ):  # fmt: skip
            outs = []
            for config in configs:
                setattr(module, name, lambda *_, c=config: [c])
                _tuning.forget_picks()
                outs.append((config, run()))
            for config, out in outs[1:]:
                assert torch.equal(out, outs[0][1]), f"{config} differs from {outs[0][0]}"
    finally:
        moe_kernels._gemm_candidates, moe_weight_grad._weight_grad_candidates = real
        _tuning.forget_picks()


def test_gemm_bits_do_not_depend_on_the_tile(triton_kernels):
    def tiles(m_key, n_key, k_key, k):
        return [
            triton.Config({m_key: a, n_key: b, k_key: k}) for a, b in ((16, 64), (32, 16), (64, 32))
        ]

    p = {**SMALL, "T": 30, "d": 70, "h": 40, "E": 3, "empty": 0, "strided": True}
    check_tile_independence(p, torch.device("cpu"), tiles("BLOCK_M", "BLOCK_N", "BLOCK_K", 64),
                            tiles("BLOCK_N", "BLOCK_K", "BLOCK_M", 16), exact=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemm_bits_do_not_depend_on_the_tile_gpu(dtype, triton_kernels):
    """The GPU tiles: 128- and 64-row wgmma ones and the 32-row mma ones alike."""
    p = {**GPU_PROBLEMS["E8-d512-drop"], "dtype": dtype, "seed": 1}
    check_tile_independence(p, torch.device("cuda"), moe_kernels.grouped_matmul_configs(),
                            moe_weight_grad.weight_grad_configs())  # fmt: skip


def _f(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


def _i(*shape, dtype=torch.int64):
    return torch.ones(shape, dtype=dtype)


@pytest.mark.parametrize(
    "fn, args, error, match",
    [
        (grouped_matmul, (_f(4, 3), _f(2, 5, 4), _i(2)), ValueError, r"w must be \(2, 5, 3\)"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3), _i(3)), ValueError, r"\(3, 5, 3\).*3 experts"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3, dtype=torch.float16), _i(2)), TypeError,
         "float16"),
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3), _f(2)), ValueError, "counts must be int64"),
        (grouped_swiglu, (_f(4, 3), _f(2, 5, 3), _f(2, 6, 3), _i(2)), ValueError,
         r"w3 must be \(2, 5, 3\)"),
        (grouped_swiglu, (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2), _i(3, dtype=torch.int16)),
         ValueError, r"rows must be int32 or int64 \(3,\)"),
        (grouped_swiglu_backward, (_f(4, 3), _f(2, 3, 5), _f(4, 9), _i(2)), ValueError,
         r"\(4, 2h\)"),
        (grouped_swiglu_input_grad, (_f(4, 8), _f(2, 5, 3), _f(2, 5, 3), _i(2)), ValueError,
         r"\(2, 4, 3\)"),
        (grouped_weight_grad, (_f(4, 5), _f(3, 2), _i(2)), ValueError, "dy's 4 rows"),
        (gather_rows, (_f(4, 3), _i(2), _f(3)), ValueError, r"float32 \(2,\)"),
        (combine, (_f(4, 3), _i(2, 2), _f(2, 3)), ValueError, r"\(2, 3\)"),
        (combine_weight_grad, (_f(2, 4), _f(4, 3), _i(2, 2)), ValueError, r"\(2, D\)"),
    ],
)  # fmt: skip
def test_kernel_bad_input_is_a_clear_error(fn, args, error, match):
    with pytest.raises(error, match=match):
        fn(*args)


@pytest.mark.parametrize(
    "fn, args, kwargs, match",
    [
        (grouped_matmul, (_f(4, 3), _f(2, 5, 3), _i(2)), {"bias": _f(2, 4)},
         r"bias must be \(2, 5\)"),
        (grouped_swiglu, (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2)),
         {"bias": (_f(2, 5), _f(5, 2))}, r"b3 must be \(2, 5\)"),
        (grouped_swiglu, (_f(4, 3), _f(2, 5, 3), _f(2, 5, 3), _i(2)), {"activation": "gelu"},
         r"activation must be one of \('silu', 'clamped_swiglu'\), got 'gelu'"),
        (grouped_swiglu_backward, (_f(4, 3), _f(2, 3, 5), _f(4, 10), _i(2)),
         {"activation": "clamped_swiglu", "limit": 0.0},
         "swiglu_limit must be a positive finite number, got 0.0"),
        (grouped_weight_grad, (_f(4, 5), _f(4, 0), _i(2)), {"bias_grad": True},
         r"bias_grad needs x with columns, got \(4, 0\)"),
    ],
)  # fmt: skip
def test_kernel_bias_and_activation_errors(fn, args, kwargs, match, each_implementation):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


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
    ref, _ = moe_reference(x.double(), router.double(), w1.double(), w2.double(),
                           w3.double(), top_k=k)  # fmt: skip
    peers = [bench_moe._naive_moe]
    if hasattr(torch, "_grouped_mm"):
        peers.append(bench_moe._grouped_mm_moe)
    for peer in peers:
        torch.testing.assert_close(peer(x, router, w1, w2, w3, k).double(), ref, rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    ids = bench_moe._routing(8, True, torch.Generator().manual_seed(0), 32, 4, "cpu")
    assert ids.shape == (32, 4) and all(len(set(r)) == 4 for r in ids.tolist())
    if not torch.cuda.is_available():
        bench_moe.main()  # says why and returns: no GPU here
        assert "no CUDA device" in capsys.readouterr().out
