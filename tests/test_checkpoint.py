"""Distributed checkpoints (`fp.checkpoint`) of the demo model on the full mesh: saved
at one layout, loaded at another, every parameter and AdamW moment equals the gathered
original bit for bit, and training goes on with the uninterrupted run's losses; a
checkpoint of another model fails on every rank, naming the tensor, with nothing loaded.
"""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_llama import Config, ParallelTransformer, Transformer  # noqa: E402

SEQ, BATCH, SAVED_AT = 16, 4, 2  # BATCH sequences per step, split over dp


def _config(moe: bool, d_model: int = 32, experts: int = 4, n_layers: int = 1) -> Config:
    # 4 heads (TP up to 4) of dimension 8: small, for Triton's interpreter
    return Config(vocab=64, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=4,
                  d_hidden=32, num_experts=experts if moe else 0, top_k=2)  # fmt: skip


def _build(layout, moe=False, fsdp=True, **config):
    """The demo model at (dp, cp, tp) (experts over tp), on the full mesh, under FSDP2
    over dp (``fsdp``: True by this torch's own path, dp_mesh_dims from 2.12; False by
    the torch 2.11 path; None without), and its AdamW."""
    dp, cp, tp = layout
    dims = fp.ParallelDims(dp=dp, cp=cp, tp=tp, ep="tp" if moe else None)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(_config(moe, **config)), dims.groups(mesh))
    fp.distribute(model, mesh)
    if fsdp is not None:
        dims.fully_shard(model, mesh, dp_mesh_dims=None if fsdp else False)
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(mesh, model, optimizer, steps) -> list[float]:
    """AdamW steps on the same batches at any layout; the losses of the whole batch."""
    losses = []
    for step in steps:
        data = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = data.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]
        loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / mesh["dp"].size())
    return losses


def _gathered(model, optimizer) -> dict:
    """Every parameter and optimizer state tensor, as full tensors."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor().clone()  # not a view: training goes on
        for key, value in optimizer.state[param].items():
            full = value.full_tensor() if key != "step" else value
            out[f"{name}.{key}"] = full.clone()
    return out


def _run_save(path, layout, moe, fsdp, steps_on):
    mesh, model, optimizer = _build(layout, moe, fsdp)
    _train(mesh, model, optimizer, range(SAVED_AT))
    fp.checkpoint.save(path, model, optimizer, extra={"step": SAVED_AT})
    gathered = _gathered(model, optimizer)
    return gathered, _train(mesh, model, optimizer, steps_on)


def _run_load(path, layout, moe, fsdp, steps_on):
    mesh, model, optimizer = _build(layout, moe, fsdp)
    extra = fp.checkpoint.load(path, model, optimizer)
    return extra, _gathered(model, optimizer), _train(mesh, model, optimizer, steps_on)


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, world, tmp_path_factory):
    """Trained SAVED_AT steps and saved at (dp=2, tp=2) (experts over tp: EP=2; MoE
    through FSDP2's torch 2.11 path), then trained on (dense; the MoE checkpoint is
    checked bitwise only, a step costs seconds in the interpreter): (kind, path,
    tensors, steps trained on, their losses)."""
    moe = request.param == "moe"
    path = str(tmp_path_factory.mktemp(request.param))
    steps_on = [] if moe else [SAVED_AT, SAVED_AT + 1]
    gathered, losses = world(4).run(_run_save, path, (2, 1, 2), moe, not moe, steps_on)[0]
    return request.param, path, gathered, steps_on, losses


@pytest.mark.parametrize("layout, fsdp", [((1, 1, 4), True), ((1, 2, 2), None), ((4, 1, 1), True),
                                          ((1, 1, 1), None)],
                         ids=["dp1-tp4", "tp2-cp2-no-fsdp", "dp4-tp1", "one-rank"])  # fmt: skip
def test_loads_bitwise_at_another_layout(world, saved, layout, fsdp):
    kind, path, expected, steps_on, losses = saved
    if (
        kind == "moe"
        and layout in ((1, 2, 2), (1, 1, 1))
        or kind == "dense"
        and layout == (4, 1, 1)
    ):
        pytest.skip("covered by the other model")
    world_size = layout[0] * layout[1] * layout[2]
    results = world(world_size).run(_run_load, path, layout, kind == "moe", fsdp, steps_on)
    extra, loaded, resumed = results[0]
    assert extra == {"step": SAVED_AT}
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    # the same parameters, another reduction order: rounding apart, grown by one AdamW step
    torch.testing.assert_close(resumed, losses, rtol=1e-5, atol=0)


WRONG = {"d_model": {"d_model": 64}, "experts": {"experts": 8}, "layers": {"n_layers": 0},
         "path on rank 3": {}}  # fmt: skip


def _run_load_wrong(path, what):
    """Load a checkpoint of another model (or, on one rank, a path that is not there):
    the error, and whether anything changed."""
    mesh, model, optimizer = _build((1, 1, 4), moe=True, fsdp=None, **WRONG[what])
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    if what == "path on rank 3" and dist.get_rank() == 3:
        path += "-typo"
    try:
        fp.checkpoint.load(path, model, optimizer)
    except ValueError as e:
        unchanged = all(
            torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters()
        )
        return str(e), unchanged and not optimizer.state
    return None, None


@pytest.mark.parametrize("what, match", [
    ("d_model", r"model\.embed\.weight is \(64, 64\) in the model but \(64, 32\)"),
    ("experts", r"router_weight is \(8, 32\) in the model but \(4, 32\)"),
    ("layers", r"has model\.blocks\.0\..*, which the model does not \(\d+ such"),
    ("path on rank 3", r"cannot load \(rank 3\): FileNotFoundError"),
])  # fmt: skip
def test_a_checkpoint_of_another_model_fails_on_every_rank(world, saved, what, match):
    """...before any rank reads it, and every rank: none is left waiting in DCP."""
    kind, path = saved[:2]
    if kind != "moe":
        pytest.skip("the MoE checkpoint has both")
    for message, untouched in world(4).run(_run_load_wrong, path, what):
        assert message is not None and re.search(match, message), message
        assert untouched


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_param_groups_by_index_still_loads(tmp_path):
    """Checkpoints written before the optimizer's groups were saved per parameter."""
    import torch.distributed.checkpoint as dcp

    from fusedpar.checkpoint import BY_GROUP, _state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    dcp.save(_state(model, optimizer, BY_GROUP), checkpoint_id=str(tmp_path))
    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fp.checkpoint.load(str(tmp_path), fresh, fresh_optimizer)
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.5
    for param, before in zip(fresh.parameters(), model.parameters(), strict=True):
        saved = optimizer.state[before]["exp_avg"]
        assert torch.equal(fresh_optimizer.state[param]["exp_avg"], saved)
