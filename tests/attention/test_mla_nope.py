"""`fp.nn.ParallelMLA` with no rotary embedding (``rope=None``: Kimi Linear's "NoPE MLA",
whose shared k dims stay, unrotated) against Hugging Face's ``KimiLinearAttention``
(tiny, every parameter re-drawn): the output and every parameter's gradient, with the
shared dims and with none (dr = 0); and over a ring of 2 (the latent ring and the
expanded one) equal to the one-process layer. TP2: tests/hf/test_hf_kimi.py."""

import copy

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.nn.mla import ParallelMLA, layer_rows
from fusedpar.testing import assert_close

modeling = pytest.importorskip(
    "transformers.models.kimi_linear.modeling_kimi_linear",
    reason="the [test] extra installs transformers",
)

D_MODEL, HEADS, NOPE, V_DIM, KV_LORA, SEQ = 24, 4, 8, 8, 12, 16
# our parameter -> Hugging Face's
NAMES = {
    "q_weight": "q_proj.weight",
    "kv_a_weight": "kv_a_proj_with_mqa.weight",
    "kv_a_norm_weight": "kv_a_layernorm.weight",
    "kv_b_weight": "kv_b_proj.weight",
    "o_weight": "o_proj.weight",
}


def _module(rope_dim: int, seed: int):
    config = modeling.KimiLinearConfig(
        hidden_size=D_MODEL,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=KV_LORA,
        q_lora_rank=None,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=rope_dim,
        v_head_dim=V_DIM,
        num_hidden_layers=1,
        attn_implementation="eager",
    )
    module = modeling.KimiLinearAttention(config, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.4 if p.dim() == 2 else 0.3))
            if "norm" in name:
                p.add_(1.0)
    return module


def _layer(module, dtype=None, **placement):
    return ParallelMLA.from_dense(
        module.q_proj,
        module.kv_a_proj_with_mqa,
        module.kv_b_proj,
        module.o_proj,
        D_MODEL,
        HEADS,
        kv_a_norm=module.kv_a_layernorm,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=module.qk_rope_head_dim,
        v_head_dim=V_DIM,
        norm_eps=module.kv_a_layernorm.variance_epsilon,
        softmax_scale=module.scaling,
        rope=None,
        dtype=dtype,
        **placement,
    )


def _run_layer(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, **grads}


def _run_hf(module, x, dy, dtype):
    """Hugging Face's module (batch-first inside) in `dtype`: y, dx sequence-first and
    its gradients in the layer's names and row order."""
    module = copy.deepcopy(module).to(dtype)
    xb = x.transpose(0, 1).to(dtype).clone().requires_grad_()
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=dtype).triu(1)[None, None]
    y, _ = module(xb, attention_mask=mask)
    y.backward(dy.transpose(0, 1).to(dtype))
    rows = dict(nope=NOPE, rope=module.qk_rope_head_dim, kv_lora_rank=KV_LORA)
    grads = {
        ours: layer_rows(ours, module.get_parameter(theirs).grad, **rows)
        for ours, theirs in NAMES.items()
    }
    return {"y": y.detach().transpose(0, 1), "dx": xb.grad.transpose(0, 1), **grads}


@pytest.mark.parametrize("rope_dim", [8, 0])
def test_nope_mla_matches_hugging_face(rope_dim):
    module = _module(rope_dim, seed=rope_dim)
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(SEQ, 2, D_MODEL, generator=gen) for _ in range(2))
    ours = _run_layer(_layer(module), x, dy)
    exact = _run_layer(_layer(module, torch.float64), x.double(), dy.double())
    hf64, hf32 = (_run_hf(module, x, dy, dtype) for dtype in (torch.float64, torch.float32))
    for name, got in ours.items():
        # Hugging Face's latent norm computes in fp32 even in a float64 module
        scale = exact[name].abs().max().item()
        assert (hf64[name] - exact[name]).abs().max() <= 1e-5 * scale, name
        assert_close(got, exact[name], hf32[name], name=name, sum_length=SEQ * 2)


def _ring(cp_ring, seed):
    """This rank's shard of the NoPE layer's output over a zigzag ring of the world,
    and every gradient summed over the ring."""
    group = dist.group.WORLD
    module = _module(8, seed)
    layer = _layer(module, cp_group=group, cp_ring=cp_ring)
    gen = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(SEQ, 2, D_MODEL, generator=gen) for _ in range(2))
    whole = _run_layer(_layer(module), x, dy)
    x, dy = (fp.shard_sequence(t, group, dim=0) for t in (x, dy))
    ours = _run_layer(layer, x, dy)
    assert layer.latent_ring(x) == (cp_ring == "latent")
    torch.testing.assert_close(ours["y"], fp.shard_sequence(whole["y"], group, dim=0))
    for name, param in layer.named_parameters():
        dist.all_reduce(param.grad)
        err = (param.grad - whole[name]).abs().max() / whole[name].abs().max()
        assert err < 1e-5, (name, err.item(), whole[name].abs().max().item())
    return True


@pytest.mark.parametrize("cp_ring", ["latent", "expanded"])
def test_nope_mla_over_a_ring_equals_one_process(world, cp_ring):
    assert all(world(2).run(_ring, cp_ring, 3))
