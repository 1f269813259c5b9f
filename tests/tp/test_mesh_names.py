"""Meshes by any name (`ParallelDims(names=...)`): a mesh whose axes fusedpar does not
know is refused wherever it enters, on every rank, never run unsharded; mapped, its
groups are the axes they claim, and a training step, FSDP2, a pipeline and a checkpoint
give bit for bit what the canonical names give."""

import re

import pytest
import torch
from tiny_llama import Config, ParallelTransformer, Transformer
from torch.distributed.device_mesh import init_device_mesh

import fusedpar as fp
from fusedpar.testing import exception_of

NAMES = {"pp": "stage", "dp": "data", "cp": "context", "tp": "tensor"}
CFG = Config(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_hidden=64)


def test_dims_with_names_stay_hashable_and_refuse_bad_maps():
    a = fp.ParallelDims(cp=2, tp=2, names={"tp": "tensor", "cp": "context"})
    b = fp.ParallelDims(cp=2, tp=2, names={"cp": "context", "tp": "tensor"})
    assert a == b and hash(a) == hash(b) and a.mesh_name("tp") == "tensor"
    assert a.mesh_name("dp") == "dp" and fp.ParallelDims(names=a.names) == fp.ParallelDims(
        names=dict(a.names)
    )
    for names, match in (
        ({"sp": "x"}, r"'sp' is not one of fusedpar's axes"),
        ({"cp": "x", "tp": "x"}, r"two axes share a mesh name"),
        ({"tp": 3}, r"must be a string"),
    ):
        with pytest.raises(ValueError, match=match):
            fp.ParallelDims(names=names)


def _step(mapped: bool, directory: str) -> list:
    """One AdamW step of the example model at TP2 x CP2 on a mesh with fusedpar's names
    or NAMES (built by `build_mesh`, whose flattened axes take the names too); then a
    checkpoint of the mapped one loaded into a canonical model. Loss, gradients,
    parameters after the step, and the loaded parameters, gathered."""
    dims = fp.ParallelDims(cp=2, tp=2, names=NAMES if mapped else {})
    mesh = dims.build_mesh("cpu")
    assert mesh.mesh_dim_names == (("data", "context", "tensor") if mapped else ("dp", "cp", "tp"))
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(CFG), dims.groups(mesh))
    fp.distribute(model, mesh, names=dims.names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = torch.randint(0, CFG.vocab, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    out = [loss.detach()] + [p.grad.full_tensor() for p in model.parameters()]
    optimizer.step()
    out += [p.full_tensor() for p in model.parameters()]
    if mapped:  # saved on the mapped mesh, loaded at the canonical names
        fp.checkpoint.save(f"{directory}/mapped", model)
        canonical = fp.ParallelDims(cp=2, tp=2)
        plain = canonical.build_mesh("cpu")
        torch.manual_seed(1)
        other = fp.distribute(ParallelTransformer(Transformer(CFG), canonical.groups(plain)), plain)
        fp.checkpoint.load(f"{directory}/mapped", other)
        out += [p.full_tensor() for p in other.parameters()]
    else:
        out += [p.full_tensor() for p in model.parameters()]
    return out


def _mapped_and_canonical(directory: str) -> bool:
    return all(
        torch.equal(a, b)
        for a, b in zip(_step(True, directory), _step(False, directory), strict=True)
    )


def test_a_mapped_mesh_trains_and_checkpoints_as_the_canonical_one(world, tmp_path):
    assert world(4).run(_mapped_and_canonical, str(tmp_path)) == [True] * 4


def _pipeline_losses(mapped: bool) -> list:
    """A 1F1B step at PP2 x DP2 with FSDP2 over dp, per stage: the losses and this
    rank's gradients and updated parameters."""
    dims = fp.ParallelDims(pp=2, dp=2, names=NAMES if mapped else {})
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    cfg = Config(vocab=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_hidden=16)
    model = ParallelTransformer(Transformer(cfg), dims.groups(mesh))
    pipe = fp.pipeline.split(model, dims, mesh, loss_fn=model.loss)
    stage = dims.stage_mesh(mesh)
    fp.distribute(pipe.model, stage, names=dims.names)
    for part in pipe.stage_modules:
        dims.fully_shard(part, stage)
    optimizer = torch.optim.AdamW(pipe.model.parameters(), lr=1e-2, fused=True)
    data = torch.randint(0, cfg.vocab, (4, 9), generator=torch.Generator().manual_seed(1))
    dp = dims.groups(mesh)["dp"]
    mine = data.chunk(2)[dp.get_local_rank()]
    losses = pipe.step(mine[:, :-1], target=mine[:, 1:]) or []
    out = [loss.detach() for loss in losses]
    out += [p.grad.full_tensor() for p in pipe.model.parameters()]
    optimizer.step()
    return out + [p.full_tensor() for p in pipe.model.parameters()]


def _pipelines_equal() -> bool:
    mapped, canonical = _pipeline_losses(True), _pipeline_losses(False)
    return len(mapped) == len(canonical) and all(
        torch.equal(a, b) for a, b in zip(mapped, canonical, strict=True)
    )


def test_a_mapped_mesh_pipelines_and_shards_as_the_canonical_one(world):
    assert world(4).run(_pipelines_equal) == [True] * 4


def _refusals() -> dict:
    """Each entry point given a mesh it must refuse: the exception each raised."""
    dims = fp.ParallelDims(cp=2, tp=2)
    other = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("data", "context", "tensor"))
    torch.manual_seed(0)
    layer = fp.nn.ColumnParallelLinear(8, 8, other["tensor"])
    wrong = init_device_mesh("cpu", (1, 4, 1), mesh_dim_names=("dp", "cp", "tp"))
    blocks = torch.nn.Module()  # what split takes, to reach the mesh
    for name in ("embed", "norm", "head"):
        setattr(blocks, name, torch.nn.Linear(2, 2))
    blocks.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    mapped = fp.ParallelDims(cp=2, tp=2, names={"dp": "data", "cp": "context", "tp": "tensor"})
    cases = {
        "groups": lambda: dims.groups(other),
        "stage_mesh": lambda: dims.stage_mesh(other),
        "fully_shard": lambda: dims.fully_shard(layer, other),
        "distribute": lambda: fp.distribute(layer, other),
        "split": lambda: fp.pipeline.split(blocks, dims, other),
        "degrees": lambda: dims.groups(wrong),
        "left out": lambda: dims.groups(dims.build_mesh("cpu")["cp"]),  # no tp axis
    }
    out = {name: exception_of(case) for name, case in cases.items()}
    # mapped: the groups are the mesh's axes, a user-built mesh included
    groups = mapped.groups(other)
    out["mapped groups"] = [groups[a] == other[n] for a, n in (("cp", "context"), ("tp", "tensor"))]
    out["mapped distribute"] = fp.distribute(layer, other, names=mapped.names).weight.placements
    return out


def test_unknown_axis_names_and_other_degrees_are_refused_on_every_rank(world):
    unknown = r"the mesh's axes \('data', 'context', 'tensor'\) include .* not fusedpar's axes"
    expected = {
        "groups": unknown,
        "stage_mesh": unknown,
        "fully_shard": unknown,
        "distribute": unknown + r".*names=dims.names",
        "split": unknown,
        "degrees": r"the mesh's axis 'cp' \(cp\) has 4 ranks, but cp = 2",
        "left out": r"leave out tp \(2 ranks\)",
    }
    for out in world(4).run(_refusals):
        for name, match in expected.items():
            e = out[name]
            assert isinstance(e, ValueError) and re.search(match, str(e)), (name, repr(e))
        assert out["mapped groups"] == [True, True]
        assert [type(p).__name__ for p in out["mapped distribute"]] == ["Replicate"] * 2 + ["Shard"]
