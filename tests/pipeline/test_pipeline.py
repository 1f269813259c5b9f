"""Pipeline parallelism (`fp.pipeline`) at 4 ranks: the demo model cut into the stages of
each schedule torch offers, with fusedpar's TP / CP / EP layers inside them and FSDP2
over dp, trains one step like the single-device reference (the loss and every parameter
gradient, within the tolerance rule); checkpoints reshard between PP2 x TP2 and
PP1 x CP2 x TP2 bit for bit; bad configurations raise on every rank."""

import re

import pytest
import torch
import torch.distributed as dist
from tiny_llama import Config, ParallelTransformer, Transformer, reference_name

import fusedpar as fp
from fusedpar.pipeline import SCHEDULES, stage_losses_total
from fusedpar.testing import assert_close, exception_of
from tests.pipeline.helpers import _assert_equal, _gathered, _union
from tests.support import tiny

SEQ, BATCH = 8, 8


def _config(moe: bool, layers: int) -> Config:
    return tiny.config(moe, d_model=16, n_layers=layers, n_heads=2, d_hidden=16)


def _reference(cfg: Config, seed: int) -> Transformer:
    torch.manual_seed(seed)
    reference = Transformer(cfg)
    with torch.no_grad():  # norms start at 1: re-drawn, so a dropped one would show
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return reference


def _pipeline(
    degrees: dict, schedule: str, moe: bool, layers: int, fsdp: bool, seed: int, microbatches=None
):
    dims = fp.ParallelDims(**{"ep": "cp" if moe else None, **degrees})  # (degrees may name ep)
    mesh = dims.build_mesh("cpu")
    cfg = _config(moe, layers)
    reference = _reference(cfg, seed)
    model = ParallelTransformer(reference, dims.groups(mesh))
    pipe = fp.pipeline.split(
        model, dims, mesh, schedule=schedule, microbatches=microbatches, loss_fn=model.loss
    )
    stage_mesh = dims.stage_mesh(mesh)
    fp.distribute(pipe.model, stage_mesh)
    if fsdp:
        for part in pipe.stage_modules:
            dims.fully_shard(part, stage_mesh)
    return dims, mesh, cfg, reference, pipe


def _batch(cfg, seed):
    return tiny.batch(cfg, seed, BATCH, SEQ)


def _run_step(degrees, schedule, moe=False, layers=2, fsdp=False, seed=0):
    dims, mesh, cfg, reference, pipe = _pipeline(degrees, schedule, moe, layers, fsdp, seed)
    reference64 = Transformer(cfg).double()
    reference64.load_state_dict(reference.state_dict())
    inputs, labels = _batch(cfg, seed + 1)
    refs = {}
    for ref in (reference, reference64):
        loss = ref(inputs, labels)
        loss.backward()
        refs[ref] = loss.detach().reshape(1)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    mine = [t.chunk(dp)[dp_rank] for t in (inputs, labels)]
    losses = pipe.step(mine[0], target=mine[1])
    total = stage_losses_total(losses)
    dist.all_reduce(total)  # every stage's ranks: the last stage's shares, 0 elsewhere
    assert_close((total / dp).reshape(1), refs[reference64], refs[reference], name="loss")
    ref32, ref64 = dict(reference.named_parameters()), dict(reference64.named_parameters())
    names = []
    for name, param in pipe.model.named_parameters():
        theirs = reference_name(name)
        assert_close(param.grad.full_tensor(), ref64[theirs].grad, ref32[theirs].grad, name=name)
        names.append(theirs)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    assert set().union(*map(set, gathered)) == set(ref32)  # every parameter, on some stage
    return True


SINGLE = [name for name, style in SCHEDULES.items() if style == "single"]
MULTI = [name for name, style in SCHEDULES.items() if style != "single"]


LAYOUTS = {  # name: (degrees, MoE, FSDP2 over dp)
    "pp2-tp2": (dict(pp=2, tp=2), False, False),
    "pp2-cp2-moe-ep-over-cp": (dict(pp=2, cp=2), True, False),
    "pp2-dp2-fsdp": (dict(pp=2, dp=2), False, True),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_the_reference(world, layout, schedule):
    """Every schedule torch offers, at each layout; two stages per pipeline rank (4
    layers) for the interleaved and V schedules."""
    degrees, moe, fsdp = LAYOUTS[layout]
    layers = 2 if schedule in SINGLE else 4
    assert all(world(4).run(_run_step, degrees, schedule, moe, layers, fsdp))


def test_experts_over_dp_in_a_pipeline(world):
    """PP 2 x EP 2 over dp 2 under FSDP2 (the experts left to fusedpar: their gradients
    scaled by 1/2, no dp reduction), 1F1B: the loss and every gradient as the
    reference's (#57; the demo's loss parity cannot see a gradient scale under AdamW)."""
    degrees = dict(pp=2, dp=2, ep="dp")
    assert all(world(4).run(_run_step, degrees, "1F1B", True, 2, True))


def _bad(case):
    degrees, schedule, layers, microbatches, batch = case
    dims = fp.ParallelDims(**degrees)
    if batch is None:  # the degrees and the pipeline at once, as a script checks first
        dims.validate(
            dist.get_world_size(), n_layers=layers, microbatches=microbatches, schedule=schedule
        )
    dims.validate(dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    cfg = _config(False, layers)
    model = ParallelTransformer(_reference(cfg, 0), dims.groups(mesh))
    pipe = fp.pipeline.split(
        model, dims, mesh, schedule=schedule, microbatches=microbatches, loss_fn=model.loss
    )
    tokens = torch.zeros(batch, SEQ, dtype=torch.long)
    pipe.step(tokens, target=tokens)


@pytest.mark.parametrize(
    "case, match",
    [
        ((dict(pp=3), "1F1B", 2, None, 4), r"pp \(3\) x dp \(1\) .* = 3, but the world has 4"),
        ((dict(pp=2, tp=2), "1F1B", 3, None, 4), r"3 layers do not divide into the 2 stages"),
        ((dict(pp=2, tp=2), "Interleaved1F1B", 2, None, 4), r"2 layers do not divide into the 4"),
        ((dict(pp=2, tp=2), "1F1B", 2, 1, 4), r"1 microbatches for 2 pipeline stages"),
        ((dict(pp=2, tp=2), "1F1B", 2, 2, 3), r"\(3, 8\) does not split into 2 microbatches"),
        ((dict(pp=2, tp=2), "Zigzag", 2, 2, 4), r"schedule must be one of"),
        ((dict(pp=2, tp=2), "DualPipeV", 8, 3, None), r"3 microbatches for 4 pipeline stages"),
    ],
)
def test_bad_configurations_raise_on_every_rank(world, case, match):
    for e in world(4).run(exception_of, _bad, case):
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def _save_or_load(degrees, save_to=None, load_from=None):
    """The 2-layer model at `degrees` (PP through `fp.pipeline`, else the whole model on
    the mesh): one AdamW step (or a checkpoint loaded), then saved; this rank's tensors."""
    dims = fp.ParallelDims(**degrees)
    mesh = dims.build_mesh("cpu")
    cfg = _config(False, 2)
    model = ParallelTransformer(_reference(cfg, 0), dims.groups(mesh))
    if dims.pp > 1:
        pipe = fp.pipeline.split(model, dims, mesh, loss_fn=model.loss)
        model = fp.distribute(pipe.model, dims.stage_mesh(mesh))
    else:
        fp.distribute(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if load_from is None:
        inputs, labels = _batch(cfg, 1)
        if dims.pp > 1:
            pipe.step(inputs, target=labels)
        else:
            model(inputs, labels).backward()
        optimizer.step()
    else:
        fp.checkpoint.load(load_from, model, optimizer)
        assert all("betas" in group for group in optimizer.param_groups)  # the groups too
    if save_to is not None:
        fp.checkpoint.save(save_to, model, optimizer)
    return _gathered(model, optimizer)


def test_checkpoints_reshard_between_pipeline_layouts_bitwise(world, tmp_path):
    """Saved at PP2 x TP2 (each pipeline rank its stage's tensors, under the unsplit
    model's names; the optimizer's param groups per parameter, as each stage's differ),
    loaded there and at PP1 x CP2 x TP2, saved again and loaded at PP2 x TP2."""
    pp2, pp1 = dict(pp=2, tp=2), dict(cp=2, tp=2)
    first, second = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    trained = _union(world(4).run(_save_or_load, pp2, first))
    assert any(".exp_avg" in name for name in trained)
    _assert_equal(_union(world(4).run(_save_or_load, pp2, None, first)), trained)
    _assert_equal(world(4).run(_save_or_load, pp1, second, first)[0], trained)
    _assert_equal(_union(world(4).run(_save_or_load, pp2, None, second)), trained)
