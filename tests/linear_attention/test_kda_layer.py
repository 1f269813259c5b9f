"""`fp.nn.KimiDeltaAttention` (Kimi Linear's KDA) against Hugging Face's
``KimiLinearDeltaAttention`` (tiny, every parameter re-drawn; its torch fallback, which
computes in fp32): output, dx and every parameter's gradient on one process and at TP2
(gloo; sequence parallel with the ring schedule, and classic TP), each rank holding its
heads of every section and the low-rank gates whole; packed documents equal to each
document run alone; bad configs refused; at TP2 x CP2 equal to one process; a DCP
checkpoint saved at TP2 loading at TP1 bit for bit; torch.compile(fullgraph=True) equal
to eager."""

import copy

import pytest
import torch
from torch import nn

import fusedpar as fp
from fusedpar.nn.kimi_delta import SPLIT_DIMS, KimiDeltaAttention, dense_kda
from tests.linear_attention.layer_helpers import BATCH, SEQ, check_against_hf, run_layer

modeling = pytest.importorskip(
    "transformers.models.kimi_linear.modeling_kimi_linear",
    reason="the [test] extra installs transformers",
)

D_MODEL, H, K, W = 20, 4, 8, 4
# Hugging Face's parameter of each of the layer's parts, read independently of
# `fusedpar.nn.kimi_delta` (its conv's rows q | k | v, its A_log (1, 1, H, 1))
THEIRS = {
    "q": "q_proj.weight",
    "k": "k_proj.weight",
    "v": "v_proj.weight",
    "b": "b_proj.weight",
    "f_a": "forget_gate.f_a_proj.weight",
    "f_b": "forget_gate.f_b_proj.weight",
    "dt_bias": "forget_gate.dt_bias",
    "g_a": "g_a_proj.weight",
    "g_b": "g_b_proj.weight",
    "norm": "o_norm.weight",
    "o": "o_proj.weight",
}


def hf_module(seed: int) -> nn.Module:
    config = modeling.KimiLinearConfig(
        hidden_size=D_MODEL,
        linear_num_heads=H,
        linear_head_dim=K,
        linear_conv_kernel_dim=W,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    module = modeling.KimiLinearDeltaAttention(config, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (D_MODEL**-0.5 if p.dim() == 2 else 0.5))
            if "norm" in name:  # around 1, never 1 everywhere
                p.add_(1.0)
    return module


def hf_parts(tensors: dict) -> dict:
    """The layer's full tensors of a module whose parameter `name` holds ``tensors[name]``."""
    parts = {ours: tensors[theirs] for ours, theirs in THEIRS.items()}
    parts["A_log"] = tensors["forget_gate.A_log"].reshape(H)
    conv = tensors["conv1d.weight"].squeeze(1)
    parts.update(conv_q=conv[: H * K], conv_k=conv[H * K : 2 * H * K], conv_v=conv[2 * H * K :])
    return {name: t.detach().clone() for name, t in parts.items()}


def run_hf(module, x, dy) -> dict:
    module = copy.deepcopy(module)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    grads = hf_parts({n: p.grad for n, p in module.named_parameters()})
    y, dx = y.detach().transpose(0, 1), x.grad.transpose(0, 1)
    return {"y": y, "dx": dx, **{f"d{n}": g for n, g in grads.items()}}


def _inputs(seed, batch=BATCH):
    gen = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randn(batch, SEQ, D_MODEL, generator=gen) for _ in range(2))


def _exact(module, x, dy, cu_seqlens=None):
    layer = KimiDeltaAttention.from_dense(module, dtype=torch.float64)
    x, dy = (t.transpose(0, 1).double() for t in (x, dy))
    return run_layer(layer, x, dy, cu_seqlens)


def test_matches_hugging_face_on_one_process():
    module = hf_module(3)
    x, dy = _inputs(3)
    layer = KimiDeltaAttention.from_dense(module)
    assert layer.spec.norm_eps == module.o_norm.variance_epsilon and layer.A_log.shape == (H,)
    ours = run_layer(layer, x.transpose(0, 1), dy.transpose(0, 1))
    assert set(ours) == {"y", "dx"} | {f"d{p}" for p in SPLIT_DIMS}
    check_against_hf(ours, _exact(module, x, dy), run_hf(module, x, dy))
    # the inverse gives Hugging Face's state back, tensor for tensor
    back = dense_kda(layer, dict(layer.named_parameters()))
    assert all(torch.equal(back[n], p) for n, p in module.state_dict().items())


def _tp2(seed):
    dims = fp.ParallelDims(tp=2)
    mesh = dims.build_mesh("cpu")
    module = hf_module(seed)
    dense = hf_parts(dict(module.named_parameters()))
    x, dy = _inputs(seed)
    for sequence_parallel, overlap in ((True, "ring"), (False, None)):
        placement = dims.placement(mesh, sequence_parallel=sequence_parallel, overlap=overlap)
        rank = fp.comm.group_rank(placement.tp_group)
        layer = KimiDeltaAttention.from_dense(module, placement)
        for part, dim in SPLIT_DIMS.items():  # its heads of each section; the gates' a whole
            expected = dense[part] if dim is None else dense[part].chunk(2, dim)[rank]
            assert torch.equal(getattr(layer, layer.param_name(part)).detach(), expected), part
        fp.distribute(layer, mesh, token_axes=("tp",) if sequence_parallel else ())

        def local(name, t, sp=sequence_parallel, rank=rank):  # (S, B, d): this rank's tokens
            return t.chunk(2)[rank] if sp else t

        xs, dys = (local("", t.transpose(0, 1)) for t in (x, dy))
        ours = run_layer(layer, xs, dys)
        check_against_hf(ours, _exact(module, x, dy), run_hf(module, x, dy), local)
    with pytest.raises(ValueError, match=r"n_heads \(3\) is not divisible by the TP degree \(2\)"):
        KimiDeltaAttention(D_MODEL, 3, head_dim=K, tp_group=placement.tp_group, device="meta")
    return True


def test_tp2_matches_hugging_face_with_and_without_sequence_parallelism(world):
    assert all(world(2).run(_tp2, 4))


def test_packed_documents_equal_each_document_alone():
    layer = KimiDeltaAttention.from_dense(hf_module(5), dtype=torch.float64)
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


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(head_dim=0), ValueError, "head_dim must be positive"),
        (dict(head_dim=2.0), TypeError, "head_dim must be an int"),
        (dict(conv_size=5), ValueError, r"conv_size \(5\) must be <= 4"),
        (dict(head_dim=320), ValueError, r"head_dim \(320\) must be <= 256"),
        (dict(norm_eps=0.0), ValueError, "norm_eps must be > 0"),
        (dict(conv_bias=True), TypeError, r"unexpected keyword\(s\) \['conv_bias'\]"),
    ],
)
def test_bad_configs_are_refused(options, error, match):
    kwargs = dict(head_dim=K) | options
    with pytest.raises(error, match=match):
        KimiDeltaAttention(D_MODEL, H, device="meta", **kwargs)


def test_keywords_and_spec_build_the_same_layer_and_from_dense_refuses():
    torch.manual_seed(0)
    a = KimiDeltaAttention(D_MODEL, H, head_dim=K, norm_eps=1e-6)
    torch.manual_seed(0)
    b = KimiDeltaAttention.from_spec(fp.nn.KimiDeltaSpec(D_MODEL, H, head_dim=K, norm_eps=1e-6))
    assert a.spec == b.spec and a.placement == b.placement
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert (-b.A_log.exp()).max() < 0 and a(torch.randn(5, 1, D_MODEL)).shape == (5, 1, D_MODEL)
    module = hf_module(1)
    module.activation = "gelu"
    with pytest.raises(ValueError, match="conv activation 'gelu'"):
        KimiDeltaAttention.from_dense(module)
    module = hf_module(1)
    module.b_proj = nn.Linear(D_MODEL, H, bias=True)
    with pytest.raises(ValueError, match=r"\['b_proj'\] with a bias"):
        KimiDeltaAttention.from_dense(module)
    with pytest.raises(TypeError, match="a placement and keywords"):
        KimiDeltaAttention.from_dense(hf_module(1), fp.Placement(), overlap="ring")


def _cp(layout, packed):
    """Ring 2 (and TP 2 on 4 ranks) against one process, float64: the convs' halos and
    the per-channel gate's span summaries."""
    dims = fp.ParallelDims(cp=2, tp=torch.distributed.get_world_size() // 2)
    mesh = dims.build_mesh("cpu")
    groups = dims.groups(mesh)
    module = hf_module(9)
    gen = torch.Generator().manual_seed(10)
    batch = 1 if packed else 2
    x, dy = (torch.randn(16, batch, D_MODEL, generator=gen, dtype=torch.float64) for _ in "xy")
    cu = torch.tensor([0, 3, 4, 13, 16], dtype=torch.int32) if packed else None
    exact = run_layer(KimiDeltaAttention.from_dense(module, dtype=torch.float64), x, dy, cu)
    placement = dims.placement(mesh, cp_layout=layout)
    layer = KimiDeltaAttention.from_dense(module, placement, dtype=torch.float64)
    fp.distribute(layer, mesh, token_axes=("cp", "tp"))

    def local(t):  # (S, B, d): the CP shard, then TP's
        t = fp.shard_sequence(t, groups["cp"], dim=0, layout=layout)
        return t.chunk(fp.comm.group_size(groups["tp"]))[fp.comm.group_rank(groups["tp"])]

    got = run_layer(layer, local(x), local(dy), cu)
    for name, value in got.items():
        ref = local(exact[name]) if name in ("y", "dx") else exact[name]
        torch.testing.assert_close(value, ref, rtol=1e-9, atol=1e-12, msg=name)
    return True


@pytest.mark.parametrize(("layout", "packed"), [("zigzag", True), ("contiguous", False)])
def test_tp2_cp2_matches_one_process(world, layout, packed):
    assert all(world(4).run(_cp, layout, packed))


def _distributed(seed):
    dims = fp.ParallelDims(tp=torch.distributed.get_world_size())
    mesh = dims.build_mesh("cpu")
    layer = KimiDeltaAttention.from_dense(hf_module(seed), dims.placement(mesh))
    return fp.distribute(layer, mesh)


def _save(path):
    layer = _distributed(seed=5)
    fp.checkpoint.save(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


def _load(path):
    layer = _distributed(seed=99)  # other weights, overwritten by the load
    fp.checkpoint.load(path, layer)
    return {n: p.full_tensor() for n, p in layer.named_parameters()}


def test_a_checkpoint_saved_at_tp2_loads_at_tp1_bit_for_bit(world, tmp_path):
    path = str(tmp_path / "step-1")
    saved = world(2).run(_save, path)[0]
    (loaded,) = world(1).run(_load, path)
    assert loaded.keys() == saved.keys()
    assert not [name for name, t in loaded.items() if not torch.equal(t, saved[name])]


def test_compiles_full_graph_equal_to_eager():
    """torch.compile(fullgraph=True) of the layer (its ops are custom ops): the output
    and every gradient equal to eager's."""
    layer = KimiDeltaAttention.from_dense(hf_module(6))
    x, dy = (t.transpose(0, 1) for t in _inputs(6))
    eager = run_layer(layer, x, dy)
    compiled = run_layer(torch.compile(layer, fullgraph=True, backend="aot_eager"), x, dy)
    compiled = {name.replace("d_orig_mod.", "d"): t for name, t in compiled.items()}
    assert compiled.keys() == eager.keys()
    for name, t in eager.items():
        torch.testing.assert_close(compiled[name], t, rtol=1e-6, atol=1e-6, msg=name)
