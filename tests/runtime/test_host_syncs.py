"""No host syncs in the hot paths: flash attention, the TP linears, the attention layer,
and the MoE layer at EP = 1.

On CPU, `HostSyncs` records the calls that would stall the host on a GPU (see
`fusedpar.testing.host_syncs`); on a GPU, ``torch.cuda.set_sync_debug_mode("error")``
turns a real sync into an error. Each path runs once to warm up (tuning a new key syncs
once, by design), then is checked forward and backward. Modules are built outside the
check: construction copies weights to the device.
"""

import contextlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing.host_syncs import HostSyncs
from fusedpar.testing.strategies import randn


def _syncs_of(step) -> str | None:
    step()  # warm-up: tuning and first-use caches
    with HostSyncs() as syncs:
        step()
    return syncs.report() if syncs.found else None


def _no_sync_on_the_gpu(step) -> None:
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _lines(syncs) -> dict[int, str]:
    """Line (in this file) -> reasons found there."""
    lines: dict[int, str] = {}
    for why, where in syncs.found:
        line = int(where.rsplit(":", 1)[1])
        lines[line] = lines.get(line, "") + why
    return lines


def _line_of(fn, text: str) -> int:
    """The line of `fn`'s source holding `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_the_detector_sees_each_kind_of_sync():
    x = torch.arange(6.0, device="cpu")
    with HostSyncs(packages=(str(Path(__file__).parents[1]),)) as syncs:
        x.sum().item()
        bool(x[0] > 0)
        x[x > 2]
        torch.bincount(x.long())
        torch.arange(3)
        repeats = torch.ones(6, dtype=torch.long, device=x.device)
        x.repeat_interleave(repeats)
        x.tolist()
        torch.tensor([1, 2], device=x.device)  # built on the host, copied over
        x.repeat_interleave(repeats, output_size=6)  # no sync
        torch.zeros(3, device=x.device)  # no sync
        x.clone()[1] = 0.0  # no sync (a scalar written on the device)
    reasons = [why for why, _ in syncs.found]
    assert len(reasons) == 8, syncs.report()
    for word in (
        "item",
        "boolean-mask",
        "bincount",
        "arange",
        "repeat_interleave",
        "tolist",
        "torch.tensor",
    ):
        assert any(word in r for r in reasons), (word, syncs.report())


def test_only_the_packages_calls_count():
    x = torch.arange(6.0)
    with HostSyncs() as syncs:  # fusedpar's: this test's syncs are not ours
        x.sum().item()
        torch.arange(3)
    assert not syncs.found, syncs.report()


def test_a_read_of_host_memory_on_a_cpu_path_is_not_a_sync():
    from fusedpar.kernels import impl

    @impl.cpu_path
    def cpu_only(t):
        return t.sum().item()

    def anywhere(t):
        return t.sum().item()

    x = torch.ones(3, device="cpu")
    with HostSyncs(packages=(str(Path(__file__).parents[1]),)) as syncs:
        cpu_only(x)
        anywhere(x)
    assert [where.rsplit(":", 1)[1] for _, where in syncs.found] == [
        str(_line_of(anywhere, ".item()"))
    ], syncs.report()


# A sync inside a custom op's body and inside backwards: a TorchFunctionMode alone sees
# the op as one call (its body runs with the mode off) and `backward` as one call.


def _syncs_inside_forward(x: torch.Tensor) -> torch.Tensor:
    if x.sum().item() > 1e30:  # forward: a read
        return x
    return x * torch.arange(x.shape[-1])  # forward: a factory without device=


_syncs_inside = torch.library.custom_op("fusedpar_test::syncs_inside", mutates_args=())(
    _syncs_inside_forward
)


@_syncs_inside.register_fake
def _(x):
    return torch.empty_like(x)


def _syncs_inside_backward(ctx, grad):
    grad[grad > 0].sum()  # backward: boolean-mask indexing
    return grad * torch.tensor([1.0, 2.0, 3.0])  # backward: a tensor from Python data


_syncs_inside.register_autograd(
    _syncs_inside_backward, setup_context=lambda ctx, inputs, output: None
)


class _SyncsInFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad if bool(grad.abs().max() < 1e30) else grad.nonzero()  # backward: a read


def test_the_detector_sees_inside_custom_ops_and_backward():
    x = torch.randn(2, 3, requires_grad=True)
    with HostSyncs(packages=(str(Path(__file__).parents[1]),)) as syncs:
        _syncs_inside(_SyncsInFunction.apply(x)).sum().backward()
    lines = _lines(syncs)
    expected = {
        _line_of(_syncs_inside_forward, ".item()"): "item",
        _line_of(_syncs_inside_forward, "torch.arange"): "arange",
        _line_of(_syncs_inside_backward, "grad > 0"): "boolean-mask",
        _line_of(_syncs_inside_backward, "torch.tensor"): "torch.tensor",
        _line_of(_SyncsInFunction.backward, "bool("): "reads a device value",
    }
    for line, word in expected.items():
        assert word in lines.get(line, ""), (line, word, syncs.report())
    assert len(syncs.found) == len(expected), syncs.report()


def test_a_torch_without_the_custom_op_lookup_says_the_bodies_go_unseen(monkeypatch):
    """The custom ops' bodies are found through a private torch function; a torch without
    it leaves them unseen and says so, once, instead of passing in silence."""
    from torch._library import custom_ops

    from fusedpar.testing import host_syncs

    monkeypatch.delattr(custom_ops, "_maybe_get_opdef")
    monkeypatch.setattr(host_syncs, "_BODIES_UNSEEN_SAID", False)
    x = torch.randn(2, 3)
    here = (str(Path(__file__).parents[1]),)
    with pytest.warns(UserWarning, match="bodies go unseen") as said, HostSyncs(here) as syncs:
        _syncs_inside(x)
        _syncs_inside(x)
    assert len(said) == 1 and syncs.found == []  # (the body's two syncs, unseen)


# --- the steps, on any device ----------------------------------------------------------


def _flash_step(device, dtype):
    q = randn((2, 19, 4, 16), dtype, 0).to(device).requires_grad_()
    k, v = (randn((2, 23, 2, 16), dtype, i).to(device).requires_grad_() for i in (1, 2))
    return lambda: fp.flash_attn(q, k, v, causal=True).float().sum().backward()


def _attention_layer_step(device, dtype):
    torch.manual_seed(0)
    layer = fp.nn.ParallelAttention(32, 4, 2, device=device, dtype=dtype)
    x = torch.randn(12, 2, 32, device=device, dtype=dtype, requires_grad=True)
    return lambda: layer(x).float().sum().backward()


def _moe_step(device, dtype, capacity_factor, **options):
    torch.manual_seed(0)
    layer = fp.nn.MoE(
        16, 12, 4, 2, capacity_factor=capacity_factor, device=device, dtype=dtype, **options
    )
    x = torch.randn(11, 16, device=device, dtype=dtype) + 1.0  # skewed: drops happen
    x.requires_grad_()

    def step():
        y, aux = layer(x)
        (y.float().square().sum() + aux).backward()

    return step


def _gated_delta_step(device, dtype):
    """fp.gated_delta_rule (GVA, one sequence past a chunk), q and k normalized in the op;
    g fp32 as the layers make it. (Packed documents read their cu_seqlens: not here.)"""
    q, k = (randn((2, 70, 2, 16), dtype, i).to(device).requires_grad_() for i in (0, 1))
    v = randn((2, 70, 4, 8), dtype, 2).to(device).requires_grad_()
    g = (-torch.rand(2, 70, 4, device=device)).requires_grad_()
    beta = torch.rand(2, 70, 4, device=device, dtype=dtype).requires_grad_()

    def step():
        o, _ = fp.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()

    return step


STEPS = {
    "flash_attn": _flash_step,
    "gated_delta_rule": _gated_delta_step,
    "attention layer": _attention_layer_step,
    "moe": lambda device, dtype: _moe_step(device, dtype, None),
    "moe with capacity": lambda device, dtype: _moe_step(device, dtype, 0.5),
    "moe gpt-oss": lambda device, dtype: _moe_step(
        device, dtype, None, bias=True, router_bias=True, activation="clamped_swiglu"
    ),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_no_host_sync(name):
    assert _syncs_of(STEPS[name]("cpu", torch.float32)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(STEPS))
def test_no_host_sync_gpu(monkeypatch, name):
    monkeypatch.setenv("FUSEDPAR_TUNING", "first")  # one compile per key: tiles are not the point
    _no_sync_on_the_gpu(STEPS[name]("cuda", torch.bfloat16))


def _tp_linears(overlap):
    torch.manual_seed(0)
    group = dist.group.WORLD
    mlp = fp.nn.ParallelSwiGLU(16, 24, group, overlap=overlap)
    column = fp.nn.ColumnParallelLinear(16, 8, group, overlap=overlap)
    row = fp.nn.RowParallelLinear(8, 16, group, overlap=overlap)
    x = torch.randn(6, 16, requires_grad=True)

    def step():
        (mlp(x).sum() + row(column(x)).sum()).backward()

    return _syncs_of(step)


@pytest.mark.parametrize("overlap", ["ring", "serial"])
def test_tp_linears_have_no_host_sync(world, overlap):
    assert world(2).run(_tp_linears, overlap) == [None, None]


# --- a whole training step of the example model ----------------------------------------


def _training_step_syncs(moe: bool, parallel: bool) -> str | None:
    """One step of the example model (forward, backward, AdamW) after a warm-up step:
    at TP2 x CP2 on the full mesh (`fp.distribute`), or in one process with no groups.
    MoE at EP = 1 (every expert on every rank): EP > 1 reads the token counts on the host
    for its all-to-all, by design. The loss read-out is the caller's."""

    from tiny_llama import Config, ParallelTransformer, Transformer

    cfg = Config(
        vocab=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_hidden=64,
        num_experts=4 if moe else 0,
        top_k=2,
    )
    torch.manual_seed(0)
    reference = Transformer(cfg)
    if parallel:
        dims = fp.ParallelDims(cp=2, tp=2)
        mesh = dims.build_mesh("cpu")
        model = fp.distribute(ParallelTransformer(reference, dims.groups(mesh)), mesh)
    else:
        model = ParallelTransformer(reference, {"tp": None, "cp": None, "ep": None})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(1))

    def step():
        loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return _syncs_of(step)


def _training_steps_syncs(parallel: bool) -> list:
    return [_training_step_syncs(moe, parallel) for moe in (False, True)]


def test_a_training_step_has_no_host_sync(world):
    """Dense and MoE (EP 1), at TP2 x CP2 on every rank and in one process."""
    assert _training_steps_syncs(False) == [None, None]
    assert world(4).run(_training_steps_syncs, True) == [[None, None]] * 4


def _check_syncs() -> list:
    """A ColumnParallelLinear on a TP group of 2: the host syncs of its first call, of
    its second, and of its second under FUSEDPAR_CHECKS=all (`fusedpar.checks`)."""
    mesh = fp.ParallelDims(cp=2, tp=2).build_mesh("cpu")
    x = torch.randn(4, 2, 8)
    out = []
    for every_call in (False, True):
        torch.manual_seed(0)
        layer = fp.nn.ColumnParallelLinear(8, 8, mesh["tp"])
        with fp.checks.every_call() if every_call else contextlib.nullcontext():
            for _ in range(2):
                with HostSyncs() as syncs:
                    layer(x)
                out.append(
                    sorted({where.rsplit("/", 1)[-1].split(":")[0] for _, where in syncs.found})
                )
    return out


def test_the_cross_rank_checks_sync_at_the_first_call_only(world):
    """The check reads its table on the host once (a GPU's one sync), none after it;
    every call under FUSEDPAR_CHECKS=all, by design."""
    for first, second, first_all, second_all in world(4).run(_check_syncs):
        assert first == first_all == second_all == ["checks.py"], (first, first_all, second_all)
        assert second == [], second
