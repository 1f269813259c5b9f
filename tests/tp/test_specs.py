"""Layers built from a spec and a placement (`fusedpar.nn.specs`, `fp.Placement`): the
keyword constructors and ``from_spec`` build the same layer (parameters bit for bit for
a seed, the same attributes), on one rank and over a mesh's groups; each spec refuses
what the layer refused, with its message; a misspelt field is a TypeError when the spec
is made; `ParallelDims.placement(mesh)` holds the groups of ``dims.groups(mesh)``; and
`hf.parallelize` builds its layers from specs."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.nn.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec
from fusedpar.testing import exception_of

MLA_SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
MOE_OPTIONS = dict(
    score="sigmoid",
    shared_hidden=5,
    shared_gate=True,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
OSS_OPTIONS = dict(bias=True, router_bias=True, activation="clamped_swiglu", swiglu_limit=5.0)


def _rope(positions):  # a rope callable: tables of width head_dim / 2 = 8
    angles = positions[:, None].float() * torch.arange(1, 9) / 16
    return angles.cos(), angles.sin()


# kind: (layer, its keyword arguments but the groups', the spec of the same)
LAYERS = {
    "attention": (
        fp.nn.ParallelAttention,
        dict(d_model=32, n_heads=4, n_kv_heads=2, bias=True, o_bias=True, qk_norm="full"),
        AttentionSpec(32, 4, 2, bias=True, o_bias=True, qk_norm="full"),
    ),
    "attention_window": (
        fp.nn.ParallelAttention,
        dict(
            d_model=32,
            n_heads=4,
            head_dim=16,
            sinks=True,
            rope=_rope,
            sliding_window=3,
            softcap=30.0,
            softmax_scale=0.2,
        ),
        AttentionSpec(
            32,
            4,
            head_dim=16,
            sinks=True,
            rope=_rope,
            sliding_window=3,
            softcap=30.0,
            softmax_scale=0.2,
        ),
    ),
    "mla": (
        fp.nn.ParallelMLA,
        dict(d_model=32, n_heads=4, q_lora_rank=12, bias=True, cp_ring="expanded", **MLA_SIZES),
        MLASpec(32, 4, q_lora_rank=12, bias=True, cp_ring="expanded", **MLA_SIZES),
    ),
    "moe": (
        fp.nn.MoE,
        dict(d_model=16, d_hidden=6, num_experts=4, top_k=2, **MOE_OPTIONS),
        MoESpec(16, 6, 4, 2, **MOE_OPTIONS),
    ),
    "moe_oss": (
        fp.nn.MoE,
        dict(d_model=16, d_hidden=6, num_experts=4, top_k=2, **OSS_OPTIONS),
        MoESpec(16, 6, 4, 2, **OSS_OPTIONS),
    ),
    "mlp": (
        fp.nn.ParallelSwiGLU,
        dict(d_model=16, d_hidden=12, bias=True, activation=F.gelu),
        MLPSpec(16, 12, bias=True, activation=F.gelu),
    ),
}


def _state(layer) -> dict:
    """A layer's attributes (its plain ones and its spec; not its placement, which a
    layer's keyword constructor makes of the fields it reads alone), parameters and
    buffers."""
    private = ("_latent_moves_less", "_rope_layout_checked", "_rope_tables")
    attributes = {
        k: v
        for k, v in vars(layer).items()
        if (not k.startswith("_") or k in private) and k != "placement"
    }
    tensors = dict(layer.named_parameters()) | dict(layer.named_buffers())
    return {"attributes": attributes, "tensors": tensors}


def _same(a, b) -> bool:
    """Two `_state`s: equal attributes, tensors equal bit for bit (dtype and shape too)."""
    if a["attributes"] != b["attributes"] or a["tensors"].keys() != b["tensors"].keys():
        return False
    return all(
        t.dtype == b["tensors"][n].dtype and torch.equal(t, b["tensors"][n])
        for n, t in a["tensors"].items()
    )


def _group_keywords(cls, placement: fp.Placement) -> dict:
    """A layer's keyword constructor's groups and options of `placement`."""
    if cls is fp.nn.MoE:
        return {"ep_group": placement.ep_group}
    if cls is fp.nn.ParallelSwiGLU:
        return dict(
            group=placement.tp_group,
            sequence_parallel=placement.sequence_parallel,
            chunks_per_rank=placement.chunks_per_rank,
            overlap=placement.overlap,
            reduce_dtype=placement.reduce_dtype,
        )
    return dict(
        tp_group=placement.tp_group,
        cp_group=placement.cp_group,
        ulysses_group=placement.ulysses_group,
        cp_mode=placement.cp_mode,
        cp_layout=placement.cp_layout,
        sequence_parallel=placement.sequence_parallel,
        overlap=placement.overlap,
        reduce_dtype=placement.reduce_dtype,
    )


def _both(kind: str, placement: fp.Placement, dtype=None):
    """The layer of `kind` built by its keyword constructor and by ``from_spec``, each
    from seed 0."""
    cls, keywords, spec = LAYERS[kind]
    torch.manual_seed(0)
    flat = cls(**keywords, **_group_keywords(cls, placement), dtype=dtype)
    torch.manual_seed(0)
    built = cls.from_spec(spec, placement, dtype=dtype)
    return flat, built


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_keywords_and_from_spec_build_the_same_layer(kind):
    placement = fp.Placement(overlap="serial", reduce_dtype=torch.bfloat16, sequence_parallel=False)
    cls = LAYERS[kind][0]
    for dtype in (None, torch.float64):
        flat, built = _both(kind, placement, dtype)
        assert type(flat) is type(built)
        assert flat.spec == built.spec == LAYERS[kind][2]
        assert built.placement is placement
        if cls is not fp.nn.MoE:  # (the MoE's reads ep_group alone)
            assert flat.placement == placement
        assert _same(_state(flat), _state(built)), kind
    # the one-rank placement by default; the meta device leaves the parameters alone
    spec = LAYERS[kind][2]
    assert cls.from_spec(spec).placement == fp.Placement()
    meta = cls.from_spec(spec, device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())


def _run_on_mesh(kinds):
    """(cp=2, tp=2, ep over tp): each layer both ways on the mesh's placement; and a
    spec of heads the TP group cannot split refused by the build, not the spec."""
    dims = fp.ParallelDims(cp=2, tp=2, ep="tp")
    mesh = dims.build_mesh("cpu")
    placement = dims.placement(mesh)
    for kind in kinds:
        flat, built = _both(kind, placement)
        assert _same(_state(flat), _state(built)), kind
        assert built.placement is placement
    spec = AttentionSpec(24, 3)
    with pytest.raises(ValueError, match=r"n_heads \(3\) is not divisible by the TP degree \(2\)"):
        fp.nn.ParallelAttention.from_spec(spec, placement)
    with pytest.raises(ValueError, match=r"ParallelMLA: n_heads \(3\) is not divisible by the TP"):
        fp.nn.ParallelMLA.from_spec(MLASpec(24, 3, q_lora_rank=None, **MLA_SIZES), placement)
    with pytest.raises(ValueError, match=r"num_experts \(3\) must be a positive multiple of "):
        fp.nn.MoE.from_spec(MoESpec(8, 4, 3, 2), placement)
    with pytest.raises(ValueError, match=r"d_hidden \(5\) is not divisible by the group size"):
        fp.nn.ParallelSwiGLU.from_spec(MLPSpec(8, 5), placement)
    with pytest.raises(ValueError, match=r"cp_ring='latent' moves the latent around a ring"):
        ulysses = fp.Placement(ulysses_group=placement.tp_group)
        fp.nn.ParallelMLA.from_spec(
            MLASpec(32, 4, q_lora_rank=None, cp_ring="latent", **MLA_SIZES), ulysses
        )
    return True


def test_keywords_and_from_spec_build_the_same_layer_on_a_mesh(world):
    kinds = ("attention", "mla", "moe", "mlp")
    assert all(world(4).run(_run_on_mesh, kinds))


def _run_placement(degrees, options):
    """`ParallelDims.placement`: the groups of `groups`, its cp_mode, `options`."""
    dims = fp.ParallelDims(**degrees)
    mesh = dims.build_mesh("cpu")
    groups, placement = dims.groups(mesh), dims.placement(mesh, **options)
    for field, axis in (("tp", "tp"), ("cp", "cp"), ("ulysses", "ulysses"), ("ep", "ep")):
        group, expected = getattr(placement, f"{field}_group"), groups[axis]
        if expected is None:
            assert group is None, field
        else:
            assert group.mesh_dim_names == expected.mesh_dim_names, field
            assert torch.equal(group.mesh, expected.mesh), field
    assert placement.cp_mode == dims.cp_mode
    assert all(getattr(placement, k) == v for k, v in options.items())
    return placement.cp_mode


@pytest.mark.parametrize(
    "degrees, options, mode",
    [
        (dict(cp=2, tp=2, ep="tp"), {}, "ring"),
        (dict(ulysses=2, tp=2, ep=("ulysses", "tp")), dict(overlap="ring"), "ulysses"),
        (dict(cp=2, ulysses=2), dict(sequence_parallel=False, cp_layout="contiguous"), "hybrid"),
    ],
)
def test_parallel_dims_placement_holds_the_groups(world, degrees, options, mode):
    assert world(4).run(_run_placement, degrees, options) == [mode] * 4


# each kind's spec and keyword constructor, and the fields every case of it starts from
BASES = {
    "attention": (AttentionSpec, fp.nn.ParallelAttention, dict(d_model=32, n_heads=4)),
    "mla": (MLASpec, fp.nn.ParallelMLA, dict(d_model=32, n_heads=4, q_lora_rank=None, **MLA_SIZES)),
    "moe": (MoESpec, fp.nn.MoE, dict(d_model=8, d_hidden=6, num_experts=4, top_k=2)),
    "placement": (fp.Placement, fp.nn.ParallelAttention, {}),
}
# (kind, the fields changed, the error and its message as the layers raised it before)
BAD = [
    ("attention", dict(rope=False), TypeError, r"rope must be a callable .* None"),
    ("attention", dict(rope=None, rotary_dim=8), ValueError, r"rotary_dim=8 with rope=None"),
    ("attention", dict(rotary_dim=10), ValueError, r"rotary_dim \(10\) must be even and in \(0, "),
    ("attention", dict(rotary_dim=5), ValueError, r"rotary_dim \(5\) must be even"),
    ("attention", dict(softmax_scale=0.0), ValueError, r"softmax_scale must be > 0 and finite"),
    ("attention", dict(sliding_window=True), TypeError, r"sliding_window must be an int"),
    ("attention", dict(sliding_window=0), ValueError, r"sliding_window=0 is Hugging Face's"),
    ("attention", dict(sliding_window=4, causal=False), ValueError, r"\(causal=False\)"),
    ("attention", dict(softcap=0.0), ValueError, r"softcap must be > 0 \(or None\)"),
    ("attention", dict(qk_norm="both"), ValueError, r"qk_norm must be False, True"),
    (
        "attention",
        dict(d_model=30),
        ValueError,
        r"d_model \(30\) is not divisible by n_heads \(4\)",
    ),
    ("attention", dict(d_model=36), ValueError, r"head_dim \(9\) must be even for the rotary"),
    (
        "attention",
        dict(n_kv_heads=3),
        ValueError,
        r"n_heads \(4\) must be a multiple of n_kv_heads",
    ),
    ("mla", dict(rope=False), TypeError, r"ParallelMLA: rope must be"),
    ("mla", dict(q_lora_rank=0), ValueError, r"q_lora_rank must be positive, got 0"),
    ("mla", dict(qk_rope_head_dim=7), ValueError, r"qk_rope_head_dim \(7\) must be even"),
    ("mla", dict(cp_ring="ring"), ValueError, r"cp_ring must be one of"),
    ("moe", dict(shared_gate=True), ValueError, r"shared_gate needs a shared expert"),
    ("moe", dict(swiglu_limit=7.0), ValueError, r"swiglu_limit apply to activation='clamped_"),
    ("moe", dict(activation="gelu"), ValueError, r"activation must be one of"),
    (
        "moe",
        dict(activation="clamped_swiglu", swiglu_alpha=float("inf")),
        ValueError,
        "swiglu_alpha must be a positive finite number, got inf",
    ),
    ("moe", dict(num_experts=0, top_k=1), ValueError, r"num_experts \(0\) must be a positive mult"),
    ("moe", dict(top_k=5), ValueError, r"top_k \(5\) must be between 1 and num_experts \(4\)"),
    ("moe", dict(score="relu"), ValueError, r"score must be one of"),
    ("moe", dict(capacity_factor=0), ValueError, r"capacity_factor must be positive"),
    ("moe", dict(n_group=3), ValueError, r"4 experts do not split into n_group=3"),
    ("moe", dict(routed_scaling_factor=0.0), ValueError, r"routed_scaling_factor must be positive"),
    ("placement", dict(overlap="rings"), ValueError, r"overlap must be None or one of"),
    ("placement", dict(reduce_dtype=torch.int32), TypeError, r"reduce_dtype must be None or a"),
    ("placement", dict(cp_mode="zigzag"), ValueError, r"cp_mode must be one of"),
]


@pytest.mark.parametrize("kind, changes, error, match", BAD)
def test_a_spec_refuses_what_the_layer_refused(kind, changes, error, match):
    """Each spec (and `Placement`) raises the error and message the layer's keyword
    constructor raised for the same value; the constructor still does, the same."""
    spec, layer, base = BASES[kind]
    with pytest.raises(error, match=match) as refused:
        spec(**{**base, **changes})
    layer_base = dict(d_model=32, n_heads=4) if kind == "placement" else base
    with pytest.raises(error) as again:
        layer(**{**layer_base, **changes})
    assert str(again.value) == str(refused.value)


@pytest.mark.parametrize(
    "build",
    [
        lambda: AttentionSpec(32, 4, n_kv_head=2),
        lambda: AttentionSpec(32, 4, 2, 8),  # head_dim is keyword-only
        lambda: MLASpec(32, 4, q_lora_rank=None, qk_rope_dim=8, **MLA_SIZES),
        lambda: MLASpec(32, 4, q_lora_rank=None),  # the head dims are required
        lambda: MoESpec(16, 6, 4, 2, topk_group=1, n_groups=1),
        lambda: MLPSpec(16, 12, activaton=F.gelu),
        lambda: fp.Placement(tp=None),
        lambda: fp.Placement(None),  # keyword-only
    ],
)
def test_a_misspelt_field_is_a_type_error_when_the_spec_is_made(build):
    with pytest.raises(TypeError):
        build()


def test_specs_are_frozen_and_from_spec_checks_its_arguments():
    spec = AttentionSpec(32, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.n_heads = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp.Placement().overlap = "ring"
    assert dataclasses.replace(spec, n_kv_heads=2).n_kv_heads == 2
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"):
        dataclasses.replace(spec, n_kv_heads=3)  # validated again
    with pytest.raises(TypeError, match="ParallelMLA.from_spec takes a MLASpec, got AttentionSpec"):
        fp.nn.ParallelMLA.from_spec(spec)
    with pytest.raises(TypeError, match="takes a fusedpar.Placement, got dict"):
        fp.nn.ParallelAttention.from_spec(spec, {"tp_group": None})
    # the values left out, derived where the layer is built
    sizes = AttentionSpec(32, 4, qk_norm=True, rope=None).resolved()
    assert sizes == (4, 8, 8, "head")
    layer = fp.nn.ParallelAttention.from_spec(AttentionSpec(32, 4, qk_norm=True, rope=None))
    assert (layer.n_kv_heads, layer.head_dim, layer.rotary_dim, layer.qk_norm) == sizes
    assert MoESpec(8, 6, 4, 2).swiglu() == (1.702, 7.0)


def _run_bad_heads():
    """A spec the TP group cannot split: the same ValueError on every rank."""
    dims = fp.ParallelDims(tp=2)
    placement = dims.placement(dims.build_mesh("cpu"))
    # (3 KV heads over TP 2: neither split nor replicated; 1 KV head would be replicated)
    fp.nn.ParallelAttention.from_spec(AttentionSpec(24, 6, 3), placement)


def test_a_group_dependent_refusal_is_the_builds(world):
    for e in world(2).run(exception_of, _run_bad_heads):
        assert isinstance(e, ValueError)
        assert re.search(r"n_kv_heads \(3\) and the TP degree \(2\): one must divide", str(e))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_parallelize_builds_its_layers_from_specs(family):
    """`hf.parallelize` (one process) builds each converted layer from a spec and the
    one-rank placement; the spec builds the same layer again."""
    pytest.importorskip("transformers")
    hf = pytest.importorskip("fusedpar.integrations.hf")
    from tests.support.hf_models import tiny_model

    model = tiny_model(family, 0)
    hf.parallelize(model, None, overlap="serial")
    kinds = {
        fp.nn.ParallelAttention: AttentionSpec,
        fp.nn.ParallelMLA: MLASpec,
        fp.nn.MoE: MoESpec,
        fp.nn.ParallelSwiGLU: MLPSpec,
    }
    built = [m for m in model.modules() if isinstance(m, tuple(kinds))]
    assert built
    for layer in built:
        cls = next(c for c in kinds if isinstance(layer, c))
        assert type(layer.spec) is kinds[cls]
        assert layer.placement == fp.Placement(overlap="serial")
        again = type(layer).from_spec(layer.spec, layer.placement, device="meta")
        shapes = {n: p.shape for n, p in layer.named_parameters()}
        assert shapes == {n: p.shape for n, p in again.named_parameters()}


def test_the_layers_initialize_cooperatively():
    """A subclass with another ``nn.Module`` base gets that base's ``__init__`` too, as the
    layers' ``super().__init__()`` gave it before they were built from specs."""

    class Mixin(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.mixin_ready = True

    for layer, args in (
        (fp.nn.ParallelSwiGLU, (8, 16)),
        (fp.nn.ParallelAttention, (16, 2)),
        (fp.nn.MoE, (8, 16, 4, 2)),
    ):
        assert type("Mixed", (layer, Mixin), {})(*args).mixin_ready, layer.__name__
