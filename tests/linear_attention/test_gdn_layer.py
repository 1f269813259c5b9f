"""`fp.nn.GatedDeltaNet` against the Hugging Face modules of Qwen3-Next, Qwen3.5 and OLMo
Hybrid (tiny, every parameter re-drawn): output, dx and every parameter's gradient, on
one process and at TP2 (gloo, with and without sequence parallelism, DTensor parameters
gathered), each TP rank's slice equal to the dense module's heads section by section;
packed documents equal to each document run alone; a CP mode the heads cannot run and
bad configs refused (CP itself: test_gdn_layer_cp.py)."""

import pytest
import torch
from torch import nn

import fusedpar as fp
from fusedpar.nn.gated_deltanet import SPLIT_DIMS, GatedDeltaNet
from fusedpar.nn.gated_deltanet_dense import check_partition, index_maps, rank_rows
from tests.linear_attention.layer_helpers import (
    BATCH,
    D_MODEL,
    FAMILIES,
    HK,
    HV,
    SEQ,
    K,
    V,
    check_against_hf,
    hf_module,
    hf_parts,
    run_hf,
    run_layer,
)


def _inputs(seed, batch=BATCH, seq=SEQ):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch, seq, D_MODEL, generator=gen), torch.randn(
        batch, seq, D_MODEL, generator=gen
    )


def _exact(module, x, dy, cu_seqlens=None):
    """Our layer in float64 on one process: the reference of every comparison."""
    layer = GatedDeltaNet.from_dense(module, dtype=torch.float64)
    x, dy = (t.transpose(0, 1).double() for t in (x, dy))
    return run_layer(layer, x, dy, cu_seqlens)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_hugging_face_on_one_process(family):
    module = hf_module(family, seed=3)
    x, dy = _inputs(3)
    layer = GatedDeltaNet.from_dense(module)
    assert layer.spec.layout == family and layer.q_weight.dtype == torch.float32
    assert layer.spec.allow_neg_eigval == (family == "olmo_hybrid")
    assert layer.spec.norm_eps == (1e-5 if family == "olmo_hybrid" else 1e-6)
    ours = run_layer(layer, x.transpose(0, 1), dy.transpose(0, 1))
    assert set(ours) == {"y", "dx"} | {f"d{p}" for p in SPLIT_DIMS}
    check_against_hf(ours, _exact(module, x, dy), run_hf(module, x, dy))


def _tp2(family, seed, sequence_parallel):
    dims = fp.ParallelDims(tp=2)
    mesh = dims.build_mesh("cpu")
    overlap = "ring" if family == "olmo_hybrid" else None  # the pipelined ring schedule too
    placement = dims.placement(mesh, sequence_parallel=sequence_parallel, overlap=overlap)
    rank = fp.comm.group_rank(placement.tp_group)
    module = hf_module(family, seed)
    x, dy = _inputs(seed)
    layer = GatedDeltaNet.from_dense(module, placement)
    # each rank holds its heads of every section, as Hugging Face's forward splits them
    dense = hf_parts(module, dict(module.named_parameters()))
    for part, dim in SPLIT_DIMS.items():
        expected = dense[part] if dim is None else dense[part].chunk(2, dim)[rank]
        assert torch.equal(getattr(layer, layer.param_name(part)).detach(), expected), part
    if family == "qwen3_5":  # a contiguous split of in_proj_qkv would mix q, k and v
        naive = module.in_proj_qkv.weight.chunk(2)[rank]
        ours = torch.cat([layer.q_weight, layer.k_weight, layer.v_weight])
        assert ours.shape == naive.shape and not torch.equal(ours, naive)
    fp.distribute(layer, mesh, token_axes=("tp",) if sequence_parallel else ())
    # each DTensor parameter is the one-rank layer's whole (what a DCP reshard reads)
    one_rank = dict(GatedDeltaNet.from_dense(module).named_parameters())
    for name, param in layer.named_parameters():
        assert torch.equal(param.full_tensor(), one_rank[name]), name

    def local(name, t):  # (S, B, d) -> this rank's tokens
        return t.chunk(2)[rank] if sequence_parallel else t

    xs, dys = (local("", t.transpose(0, 1)) for t in (x, dy))
    ours = run_layer(layer, xs, dys)
    check_against_hf(ours, _exact(module, x, dy), run_hf(module, x, dy), local)
    if family == "qwen3_5" and sequence_parallel:  # packed documents over TP too
        cu = torch.tensor([0, 3, 10, SEQ], dtype=torch.int32)
        x1, dy1 = _inputs(seed + 5, batch=1)
        packed = run_layer(layer, local("", x1.transpose(0, 1)), local("", dy1.transpose(0, 1)), cu)
        exact = _exact(module, x1, dy1, cu)
        for name, got in packed.items():
            ref = local(name, exact[name]) if name in ("y", "dx") else exact[name]
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    return True


# classic TP (no sequence parallelism): one family is enough, the layouts share its code
@pytest.mark.parametrize(
    ("family", "sequence_parallel"),
    [(family, True) for family in FAMILIES] + [("qwen3_next", False)],
    ids=[*FAMILIES, "qwen3_next-classic-tp"],
)
def test_tp2_matches_hugging_face_section_by_section(world, family, sequence_parallel):
    assert all(world(2).run(_tp2, family, 4, sequence_parallel))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_equal_each_document_alone(family):
    module = hf_module(family, seed=5)
    layer = GatedDeltaNet.from_dense(module, dtype=torch.float64)
    bounds = [0, 1, 6, SEQ]  # a one-token document, then 5, then 8
    x, dy = (t.transpose(0, 1).double() for t in _inputs(5, batch=1))
    packed = run_layer(layer, x, dy, torch.tensor(bounds, dtype=torch.int32))
    grads = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone = run_layer(layer, x[start:end], dy[start:end])
        for name in ("y", "dx"):
            torch.testing.assert_close(packed[name][start:end], alone[name], rtol=1e-12, atol=1e-12)
        for name, g in alone.items():
            if name not in ("y", "dx"):
                grads[name] = grads.get(name, 0) + g
    for name, g in grads.items():  # the parameters' gradients: the documents' sum
        torch.testing.assert_close(packed[name], g, rtol=1e-12, atol=1e-12)
    unpacked = run_layer(layer, x, dy)  # (without cu_seqlens, state does cross)
    assert not torch.allclose(unpacked["y"][1:], packed["y"][1:])


def _refusals():
    dims = fp.ParallelDims(cp=2)
    spec = fp.nn.GatedDeltaNetSpec(D_MODEL, HK, HV, head_k_dim=K, head_v_dim=V)
    with pytest.raises(ValueError, match=r"'ulysses' sends this rank's 2 k-heads .* group of 1"):
        placement = dims.placement(dims.build_mesh("cpu"), linear_cp_mode="ulysses")
        GatedDeltaNet.from_spec(spec, placement)
    dims = fp.ParallelDims(tp=2)
    placement = dims.placement(dims.build_mesh("cpu"))
    torch.manual_seed(0)  # keywords and from_spec: the same layer on the mesh too
    flat = GatedDeltaNet(D_MODEL, HK, HV, head_k_dim=K, head_v_dim=V, tp_group=placement.tp_group)
    torch.manual_seed(0)
    built = GatedDeltaNet.from_spec(spec, placement)
    assert flat.spec == built.spec and built.placement is placement
    for (name, p), q in zip(flat.state_dict().items(), built.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert built.q_weight.shape == (HK // 2 * K, D_MODEL) and built.A_log.shape == (HV // 2,)
    with pytest.raises(
        ValueError, match=r"n_k_heads \(3\) is not divisible by the TP degree \(2\)"
    ):
        GatedDeltaNet(
            D_MODEL, 3, 6, head_k_dim=K, tp_group=dims.groups(dims.build_mesh("cpu"))["tp"]
        )
    return True


def test_on_a_mesh_a_cp_mode_and_heads_off_the_tp_degree_are_refused(world):
    assert all(world(2).run(_refusals))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(n_v_heads=5), ValueError, r"n_v_heads \(5\) must be a multiple of n_k_heads \(2\)"),
        (dict(head_k_dim=0), ValueError, "head_k_dim must be positive"),
        (dict(head_v_dim=2.0), TypeError, "head_v_dim must be an int"),
        (dict(conv_size=True), TypeError, "conv_size must be an int"),
        (dict(conv_size=5), ValueError, r"conv_size \(5\) must be <= 4"),
        (dict(head_v_dim=320), ValueError, r"head_v_dim \(320\) must be <= 256"),
        (dict(norm_gate="relu"), ValueError, "norm_gate must be one of"),
        (dict(layout="mamba"), ValueError, "layout must be one of"),
        (dict(norm_eps=0.0), ValueError, "norm_eps must be > 0"),
        (dict(conv_bias=True), TypeError, r"unexpected keyword\(s\) \['conv_bias'\]"),
    ],
)
def test_bad_configs_are_refused(options, error, match):
    kwargs = dict(n_v_heads=HV, head_k_dim=K) | options
    with pytest.raises(error, match=match):
        GatedDeltaNet(D_MODEL, HK, kwargs.pop("n_v_heads"), device="meta", **kwargs)


def test_keywords_and_spec_build_the_same_layer():
    torch.manual_seed(0)
    a = GatedDeltaNet(D_MODEL, HK, HV, head_k_dim=K, head_v_dim=V, norm_gate="sigmoid")
    spec = fp.nn.GatedDeltaNetSpec(D_MODEL, HK, HV, head_k_dim=K, head_v_dim=V, norm_gate="sigmoid")
    torch.manual_seed(0)
    b = GatedDeltaNet.from_spec(spec)
    assert a.spec == b.spec and a.placement == b.placement
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    x = torch.randn(5, 1, D_MODEL)
    assert a(x).shape == x.shape
    with pytest.raises(TypeError, match="takes a GatedDeltaNetSpec, got dict"):
        GatedDeltaNet.from_spec({})

    class Mixin(nn.Module):  # cooperative: a subclass's other base is initialized too
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.mixin_ready = True

    assert type("Mixed", (GatedDeltaNet, Mixin), {})(8, 2, head_k_dim=4).mixin_ready


def test_from_dense_refuses_what_it_would_not_compute():
    with pytest.raises(ValueError, match="has none of the projections"):
        GatedDeltaNet.from_dense(nn.Linear(4, 4))
    module = hf_module("qwen3_5", seed=1)
    module.in_proj_z = nn.Linear(D_MODEL, HV * V, bias=True)
    with pytest.raises(ValueError, match="in_proj_z has a bias"):
        GatedDeltaNet.from_dense(module)
    module = hf_module("qwen3_next", seed=1)
    assert not GatedDeltaNet.from_dense(module, sequence_parallel=False).sequence_parallel
    with pytest.raises(TypeError, match="a placement and keywords"):
        GatedDeltaNet.from_dense(module, fp.Placement(), overlap="ring")
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['tp'\]"):
        GatedDeltaNet.from_dense(module, tp=2)
    module.activation = "gelu"
    with pytest.raises(ValueError, match="conv activation 'gelu', not silu"):
        GatedDeltaNet.from_dense(module)
    layer = GatedDeltaNet(D_MODEL, HK, HV, head_k_dim=K, head_v_dim=V)
    parts = hf_parts(
        hf_module("olmo_hybrid", seed=1), dict(hf_module("olmo_hybrid", 1).named_parameters())
    )
    parts["conv_v"] = parts["conv_v"][:, :3]
    with pytest.raises(ValueError, match=r"conv_v must be \(24, 4\)"):
        layer.load_parts(parts)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5", "olmo_hybrid"])
@pytest.mark.parametrize(("hk", "hv", "k", "v"), [(2, 4, 8, 6), (4, 4, 3, 5), (4, 12, 2, 3)])
def test_index_maps_split_by_heads_within_each_section(layout, hk, hv, k, v):
    maps = index_maps(layout, hk, hv, k, v)
    sizes = {}
    for name, rows in maps.values():
        sizes[name] = sizes.get(name, 0) + rows.numel()
    check_partition(maps, sizes)  # every dense row once
    for tp in (t for t in (1, 2, 4) if hk % t == 0):  # (the layer refuses others)
        for section, (_, rows) in maps.items():
            width = {"q": k, "k": k, "v": v, "z": v, "b": 1, "a": 1}[section]
            pieces = [rank_rows(rows, tp, r) for r in range(tp)]
            assert torch.equal(torch.cat(pieces), rows)
            assert all(p.numel() % width == 0 for p in pieces)  # whole heads
    bad = dict(maps, k=(maps["q"][0], maps["q"][1]))  # k's rows taken from q's
    with pytest.raises(ValueError, match="do not cover its"):
        check_partition(bad, sizes)


def _distributed(family, seed):
    """The Qwen3.5 or Qwen3-Next layer over this world's TP ranks, as DTensors."""
    dims = fp.ParallelDims(tp=torch.distributed.get_world_size())
    mesh = dims.build_mesh("cpu")
    layer = GatedDeltaNet.from_dense(hf_module(family, seed), dims.placement(mesh))
    return fp.distribute(layer, mesh)


def _save(path, family):
    layer = _distributed(family, seed=5)
    fp.checkpoint.save(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


def _load(path, family):
    layer = _distributed(family, seed=99)  # other weights, overwritten by the load
    fp.checkpoint.load(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("family, saved_at, loaded_at", [("qwen3_5", 2, 1), ("qwen3_next", 1, 2)])
def test_a_checkpoint_reshards_across_tp(world, tmp_path, family, saved_at, loaded_at):
    """DCP saves each section's heads under the layer's names: a checkpoint written at
    one TP degree loads bit for bit at another (sections stay apart at any split)."""
    path = str(tmp_path / "step-1")
    saved = world(saved_at).run(_save, path, family)[0]
    for tensors in world(loaded_at).run(_load, path, family):
        assert tensors.keys() == saved.keys()
        for name, t in tensors.items():
            assert torch.equal(t, saved[name]), name
