"""What the GatedDeltaNet layer tests share: the three families' Hugging Face modules at
tiny random sizes (every parameter re-drawn), the oracle that reads a dense module's
tensors into the layer's sections by Hugging Face's own code (independently of
`fusedpar.nn.gated_deltanet_dense`), and the runs and comparisons."""

import copy

import torch
from torch.distributed.tensor import DTensor

from fusedpar.testing import assert_close

FAMILIES = ("qwen3_next", "qwen3_5", "olmo_hybrid")
D_MODEL, HK, HV, K, V, W = 20, 2, 4, 8, 6, 4
SEQ, BATCH = 14, 2


def hf_module(family: str, seed: int) -> torch.nn.Module:
    """A float32 Hugging Face GDN module of `family`, every parameter drawn from `seed`."""
    config = dict(
        hidden_size=D_MODEL,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=K,
        linear_value_head_dim=V,
        linear_conv_kernel_dim=W,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        module = m.Qwen3NextGatedDeltaNet(m.Qwen3NextConfig(**config), 0)
    elif family == "qwen3_5":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        module = m.Qwen3_5GatedDeltaNet(m.Qwen3_5TextConfig(**config), 0)
    else:
        from transformers.models.olmo_hybrid import modeling_olmo_hybrid as m

        config["linear_allow_neg_eigval"] = True
        module = m.OlmoHybridGatedDeltaNet(m.OlmoHybridConfig(**config), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = D_MODEL**-0.5 if p.dim() == 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
            if "norm" in name:  # around 1, never 1 everywhere
                p.add_(1.0)
    return module


def hf_parts(module: torch.nn.Module, tensors: dict) -> dict:
    """The layer's full tensors (`fusedpar.nn.gated_deltanet.SPLIT_DIMS`' parts) of a
    dense module whose parameter `name` holds ``tensors[name]`` (its weights or its
    gradients), split as Hugging Face's forward splits them."""
    kd, vd = HK * K, HV * V
    parts = {}
    if "in_proj_qkvz.weight" in tensors:  # Hugging Face's own regrouping, on W^T
        mixed = tensors["in_proj_qkvz.weight"].T[None]  # (1, d, N): d "tokens"
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            mixed, tensors["in_proj_ba.weight"].T[None]
        )

        def rows(t):  # (1, d, H, D) or (1, d, H) -> (H * D, d)
            return t[0].reshape(t.shape[1], -1).T

        parts.update(q=rows(q), k=rows(k), v=rows(v), z=rows(z), b=rows(b), a=rows(a))
    elif "in_proj_qkv.weight" in tensors:
        q, k, v = torch.split(tensors["in_proj_qkv.weight"], [kd, kd, vd])
        parts.update(q=q, k=k, v=v, z=tensors["in_proj_z.weight"])
        parts.update(b=tensors["in_proj_b.weight"], a=tensors["in_proj_a.weight"])
    else:
        for ours, theirs in zip("qkvzba", ("q", "k", "v", "g", "b", "a"), strict=True):
            parts[ours] = tensors[f"{theirs}_proj.weight"]
    conv = torch.split(tensors["conv1d.weight"].squeeze(1), [kd, kd, vd])
    parts.update(conv_q=conv[0], conv_k=conv[1], conv_v=conv[2])
    norm = "o_norm.weight" if "o_norm.weight" in tensors else "norm.weight"
    out = "o_proj.weight" if "o_proj.weight" in tensors else "out_proj.weight"
    parts.update(A_log=tensors["A_log"], dt_bias=tensors["dt_bias"])
    parts.update(norm=tensors[norm], o=tensors[out])
    return {name: t.detach().clone() for name, t in parts.items()}


def run_hf(module, x, dy) -> dict:
    """The dense module's y, dx (sequence-first: (S, B, d), as the layer's) and
    gradients in the layer's parts; x, dy (B, S, d)."""
    module = copy.deepcopy(module)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    grads = hf_parts(module, {n: p.grad for n, p in module.named_parameters()})
    y, dx = y.detach().transpose(0, 1), x.grad.transpose(0, 1)
    return {"y": y, "dx": dx, **{f"d{n}": g for n, g in grads.items()}}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_layer(layer, x, dy, cu_seqlens=None) -> dict:
    """The layer's y, dx (its own local layout) and full parameter gradients by part."""
    for p in layer.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad}
    for name, p in layer.named_parameters():
        part = name.removesuffix("_weight")
        out[f"d{part}"] = full(p.grad)
    return out


def check_against_hf(ours: dict, exact: dict, hf: dict, local=lambda name, t: t) -> None:
    """Every entry of `ours` (fp32) against our float64 run `exact`, within 2x Hugging
    Face's fp32 error (`hf`); Hugging Face itself within fp32's reach of `exact` (it
    computes in fp32: the float64 exactness is the op tests'). `local(name, t)`: the
    part of a full (S, B, d) y or dx this run holds."""
    for name, got in ours.items():
        ref, theirs = exact[name], hf[name]
        if name in ("y", "dx"):
            ref, theirs = local(name, ref), local(name, theirs)
        scale = ref.abs().max().item()
        hf_err = (theirs.double() - ref).abs().max().item()
        assert hf_err <= 1e-4 * scale + 1e-6, f"{name}: Hugging Face off by {hf_err:.3g}"
        assert_close(got, ref, theirs, name=name, sum_length=SEQ * BATCH)
