"""`parallelize` on Kimi Linear (``kimi_linear``): KDA layers (`fp.nn.KimiDeltaAttention`)
among NoPE MLA layers (`fp.nn.ParallelMLA` with ``rope=None``), a dense first MLP, then
DeepSeek-style MoE (sigmoid router with its correction bias, 1 of 2 groups, scaled, a
shared expert). A tiny random model (fp32, every parameter and the router's bias
re-drawn) against the unconverted Hugging Face model: logits, loss and every
parameter's gradient in one process, at TP2 (experts over tp) and over packed documents
at TP2 (each document run alone by Hugging Face); `save_pretrained` back to the original
checkpoint; at TP2 x CP2 (the KDA layers' halos and summaries). Hugging
Face's KDA (its torch fallback) computes in fp32 even in a float64 model: the float64
reference is fp32-exact there (`_close`)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.hf_config import check_dims
from fusedpar.nn.mla import layer_rows
from fusedpar.testing import assert_close

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.support.hf_grads import reference_grad  # noqa: E402
from tests.support.hf_models import BATCH, DOCUMENTS, SEQ, SPANS, VOCAB  # noqa: E402

FP32_FLOOR = 1e-4  # x max|ref|: the float64 reference's own fp32 error (see the doc)
KIMI = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    linear_num_heads=4,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    moe_intermediate_size=24,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# the KDA's parameters -> Hugging Face's (its conv's rows q | k | v, A_log (1, 1, H, 1))
KDA_NAMES = {
    "q_weight": "q_proj.weight",
    "k_weight": "k_proj.weight",
    "v_weight": "v_proj.weight",
    "b_weight": "b_proj.weight",
    "f_a_weight": "forget_gate.f_a_proj.weight",
    "f_b_weight": "forget_gate.f_b_proj.weight",
    "dt_bias": "forget_gate.dt_bias",
    "g_a_weight": "g_a_proj.weight",
    "g_b_weight": "g_b_proj.weight",
    "norm_weight": "o_norm.weight",
    "o_weight": "o_proj.weight",
}


def _model(seed: int):
    config = transformers.KimiLinearConfig(**KIMI, experts_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():  # the router's choice bias: it must bite
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    return model


def _grad(model, name: str) -> torch.Tensor:
    """The gradient of the original parameter the converted `name` came from."""
    prefix, leaf = name.rsplit(".", 1)
    module = model.get_submodule(prefix)
    if hasattr(module, "forget_gate"):  # a KDA layer
        if leaf == "A_log":
            return module.forget_gate.A_log.grad.reshape(-1)
        if leaf.startswith("conv_"):
            return module.conv1d.weight.grad.squeeze(1).chunk(3)["qkv".index(leaf[5])]
        return module.get_parameter(KDA_NAMES[leaf]).grad
    if hasattr(module, "kv_a_proj_with_mqa"):  # NoPE MLA's rows
        config = model.config
        theirs = {"q_weight": "q_proj.weight", "kv_a_norm_weight": "kv_a_layernorm.weight"}
        theirs |= {"o_weight": "o_proj.weight"}
        theirs |= {"kv_a_weight": "kv_a_proj_with_mqa.weight", "kv_b_weight": "kv_b_proj.weight"}
        grad = module.get_parameter(theirs[leaf]).grad
        sizes = dict(nope=config.qk_nope_head_dim, rope=config.qk_rope_head_dim)
        return layer_rows(leaf, grad, **sizes, kv_lora_rank=config.kv_lora_rank)
    return reference_grad(model, name)


def _close(got, ref64, ref32, name):
    floor = FP32_FLOOR * ref64.abs().max().item()
    if (got.double() - ref64.double()).abs().max().item() <= floor:
        return
    assert_close(got, ref64, ref32, name=name, sum_length=SEQ)


def _references(model, ids, spans, labels):
    """The original in float64 and fp32, each document of `spans` run alone."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    out = {}
    for dtype in (torch.float64, torch.float32):
        ref = copy.deepcopy(model).to(dtype)
        logits = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in spans], dim=1)
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        loss.backward()
        out[dtype] = (logits.detach(), loss.detach().reshape(1), ref)
    return out


def _run(seed, degrees=None, packed=False, export=None):
    """Kimi Linear converted at `degrees` (None: one process), one step with labels= on
    the whole batch (packed: documents in one sequence) against the original's; then,
    given a directory `export`, saved there and loaded back as the original."""
    dims = None if degrees is None else fp.ParallelDims(**degrees, ep="tp")
    model = _model(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, spans, kwargs = BATCH, [(0, SEQ)], {}
    if packed:
        batch, spans = 1, SPANS
        kwargs["position_ids"] = torch.cat([torch.arange(e - s) for s, e in spans])[None]
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    labels = ids.clone()
    if packed:
        labels[0, DOCUMENTS[:-1]] = -100  # no document predicts the next one's first token
    refs = _references(model, ids, spans, labels)
    mesh = hf.parallelize(model, dims)
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers}
    assert kinds == {"HFKimiDeltaAttention", "HFParallelMLA"}
    assert model.model.layers[1].self_attn.rope is None  # NoPE
    groups = dims.groups(mesh) if dims else dict.fromkeys(("cp", "ulysses", "tp"))
    result = model(input_ids=ids, labels=labels, **kwargs)
    result.loss.backward()
    full = hf.full_logits(result.logits.detach(), groups)
    _close(full, refs[torch.float64][0], refs[torch.float32][0], "logits")
    _close(result.loss.detach().reshape(1), refs[torch.float64][1], refs[torch.float32][1], "loss")
    names = []
    for name, param in model.named_parameters():
        ref64, ref32 = (_grad(refs[dtype][2], name) for dtype in refs)
        _close(param.grad.full_tensor() if dims else param.grad, ref64, ref32, name)
        names.append(name)
    if export is not None:
        model.save_pretrained(export)
        if not dims or dist.get_rank() == 0:
            _check_export(export, refs[torch.float32][2])
    return len(names)


def _check_export(directory, original):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        directory, experts_implementation="eager"
    )
    assert type(loaded) is type(original)
    got, want = loaded.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    assert not [name for name in want if not torch.equal(got[name], want[name])]


def test_one_process_with_every_group_none_and_back_to_the_checkpoint(tmp_path):
    assert _run(1, export=str(tmp_path / "out")) > 0


def test_tp2_experts_over_tp(world):
    assert len(set(world(2).run(_run, 2, dict(tp=2)))) == 1


def test_packed_documents_at_tp2(world):
    """No state crosses a document: the convs and the recurrence restart at each."""
    assert len(set(world(2).run(_run, 3, dict(tp=2), True))) == 1


def test_tp2_cp2_experts_over_tp(world):
    """The KDA layers' halos and span summaries beside the NoPE MLA's ring, zigzag."""
    assert len(set(world(4).run(_run, 4, dict(tp=2, cp=2)))) == 1


def test_check_dims_takes_cp_and_refuses_heads_off_tp():
    config = _model(0).config
    check_dims(config, 2, 2, tp=4)  # a sequence split: taken
    with pytest.raises(ValueError, match=r"n_heads \(4\) is not divisible by the TP degree \(8\)"):
        check_dims(config, 1, tp=8)


def test_a_kda_with_a_bias_or_another_activation_is_refused():
    """Checked for every layer before anything is built (Kimi has neither)."""
    model = _model(0)
    kda = model.model.layers[2].self_attn
    kda.b_proj = torch.nn.Linear(kda.hidden_size, kda.num_heads, bias=True)
    with pytest.raises(ValueError, match=r"layer 2: a KDA projection or conv with a bias"):
        hf.parallelize(model, None)
    model = _model(0)
    model.model.layers[0].self_attn.activation = "gelu"
    with pytest.raises(ValueError, match=r"layer 0: a KDA conv with 'gelu'"):
        hf.parallelize(model, None)
