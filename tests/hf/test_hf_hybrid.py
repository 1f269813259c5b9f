"""`parallelize` on the hybrids (Gated DeltaNet layers among full attention): Qwen3-Next,
Qwen3.5 (dense and MoE) and OLMo Hybrid, tiny random models (fp32, every parameter
re-drawn), against the unconverted Hugging Face model: logits, loss and every
parameter's gradient in one process, at TP2, at TP4 over 2 KV heads (replicated;
OLMo's full-width k norm with them), at PP2 x TP2 and over packed documents (each
document run alone by Hugging Face, whose GDN refuses packing without
flash-linear-attention); `save_pretrained` back to the original
checkpoint; and under context parallelism (TP2 x CP2, CP2 x Ulysses 2, packed).
Hugging Face's GDN computes in fp32 even in a float64 model: its float64 reference is
fp32-exact there (`_close`)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar as fp
from fusedpar import plan
from fusedpar.hf_config import check_dims
from fusedpar.pipeline import stage_losses_total
from fusedpar.plan.accounting import check_heads
from fusedpar.testing import assert_close

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.support.hf_grads import reference_grad  # noqa: E402
from tests.support.hf_models import BATCH, DOCUMENTS, HYBRIDS, MOE, SEQ, SPANS, VOCAB  # noqa: E402
from tests.support.hf_models import tiny_model as _model  # noqa: E402

# x max|ref|: the float64 reference's own fp32 error (Hugging Face's GDN, its gated norm
# and Qwen's (1 + w) RMSNorms cast to fp32 inside a float64 model), which a model of 4
# layers takes to 4e-5 (seen); a wrong split is off by O(1)
FP32_FLOOR = 1e-4


def _close(got, ref64, ref32, name):
    """The tolerance rule, with the float64 reference's own fp32 error as a floor
    relative to its scale (`FP32_FLOOR`)."""
    floor = FP32_FLOOR * ref64.abs().max().item()
    err = (got.double() - ref64.double()).abs().max().item()
    if err <= floor:
        return
    assert_close(got, ref64, ref32, name=name, sum_length=SEQ)


def _references(model, ids, spans, labels):
    """The original in float64 and fp32, each document of `spans` run alone: {dtype:
    (logits, loss (1,), the model with its gradients)}."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    out = {}
    for dtype in (torch.float64, torch.float32):
        ref = copy.deepcopy(model).to(dtype)
        logits = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in spans], dim=1)
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        loss.backward()
        out[dtype] = (logits.detach(), loss.detach().reshape(1), ref)
    return out


def _check(model, refs, logits, loss, dims, groups) -> int:
    full = hf.full_logits(logits.detach(), groups)
    _close(full, refs[torch.float64][0], refs[torch.float32][0], "logits")
    _close(loss.detach().reshape(1), refs[torch.float64][1], refs[torch.float32][1], "loss")
    checked = 0
    for name, param in model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype][2], name) for dtype in refs)
        grad = param.grad.full_tensor() if dims else param.grad
        _close(grad, ref64, ref32, name)
        checked += 1
    return checked


def _run(family, seed, degrees=None, packed=False, export=None):
    """`family` converted at `degrees` (ParallelDims' keywords; None: one process, every
    group None), one step with labels= on the whole batch (packed: documents in one
    sequence, position_ids restarting) against the original's; then, given a directory
    `export`, saved there (every rank) and loaded back as the original (rank 0)."""
    dims = (
        None if degrees is None else fp.ParallelDims(**degrees, ep="tp" if family in MOE else None)
    )
    model = _model(family, seed)
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
    groups = dims.groups(mesh) if dims else dict.fromkeys(("cp", "ulysses", "tp"))
    result = model(input_ids=ids, labels=labels, **kwargs)
    result.loss.backward()
    checked = _check(model, refs, result.logits, result.loss, dims, groups)
    if export is not None:
        model.save_pretrained(export)
        if not dims or dist.get_rank() == 0:
            _check_export(export, refs[torch.float32][2])
    return checked


def _check_export(directory, original):
    """The checkpoint in `directory` loads as `original`'s class, every tensor equal;
    returns the loaded model."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        directory, experts_implementation="eager"
    )
    assert type(loaded) is type(original)
    got, want = loaded.state_dict(), original.state_dict()
    assert sorted(got) == sorted(want)
    assert not [name for name in want if not torch.equal(got[name], want[name])]
    return loaded


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_one_process_with_every_group_none(family):
    assert _run(family, 1) > 0


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_tp2(world, family):
    assert len(set(world(2).run(_run, family, 2, dict(tp=2)))) == 1


def test_tp4_replicates_the_two_kv_heads(world, tmp_path):
    """4 query heads and 2 KV heads over TP 4: each KV head on 2 ranks; the GDN's 4
    k-heads one a rank; the experts one a rank (ep over tp); exported, gathered back
    into Qwen3-Next's checkpoint."""
    results = world(4).run(_run, "qwen3_next", 3, dict(tp=4), False, str(tmp_path / "out"))
    assert len(set(results)) == 1


@pytest.mark.parametrize("family", ["olmo_hybrid", "qwen3_5_moe_text"])
def test_packed_documents_in_one_process(family):
    """No state crosses a document: the conv and the recurrence restart at each."""
    assert _run(family, 4, packed=True) > 0


def test_packed_documents_at_tp2(world):
    assert len(set(world(2).run(_run, "qwen3_5_text", 5, dict(tp=2), True))) == 1


def _run_pipeline(family: str, seed: int, degrees=None):
    """PP2 x TP2 (or `degrees`), 1F1B, a stage of a linear and a full attention layer each, packed
    documents in every microbatch: the loss and every gradient against the original's."""
    layers, microbatches = 4, 2
    kinds = ["linear_attention", "full_attention"] * 2
    model = _model(family, seed, num_hidden_layers=layers, layer_types=kinds)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (microbatches, SEQ), generator=gen)
    positions = torch.cat([torch.arange(e - s) for s, e in SPANS]).expand(microbatches, SEQ)
    labels = ids.clone()
    labels[:, DOCUMENTS[:-1]] = -100
    refs = _references(model, ids, SPANS, labels)  # the microbatches' mean of equal counts
    degrees = degrees or dict(pp=2, tp=2)
    dims = fp.ParallelDims(**degrees, ep="tp" if family in MOE and "tp" in degrees else None)
    mesh = hf.parallelize(model, dims)
    pipe = fp.pipeline.split(model, dims, mesh, schedule="1F1B", microbatches=microbatches)
    total = stage_losses_total(pipe.step(ids, target=labels, position_ids=positions))
    dist.all_reduce(total)  # the last stage's TP ranks hold a share each
    _close(total.reshape(1), refs[torch.float64][1], refs[torch.float32][1], "loss")
    names = []
    for name, param in pipe.model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype][2], name) for dtype in refs)
        _close(param.grad.full_tensor(), ref64, ref32, name)
        names.append(name)
    return len(names)


def test_pp2_tp2_with_packed_documents(world):
    assert all(n > 0 for n in world(4).run(_run_pipeline, "qwen3_5_text", 6, timeout=240))


def test_pp2_cp2_with_packed_documents(world):
    """The GDN layers' summaries and halos inside each pipeline stage."""
    degrees = dict(pp=2, cp=2)
    assert all(n > 0 for n in world(4).run(_run_pipeline, "qwen3_next", 7, degrees, timeout=240))


@pytest.mark.parametrize(
    ("family", "degrees"),
    [(family, dict(tp=2, cp=2)) for family in HYBRIDS]
    + [(family, dict(cp=2, ulysses=2)) for family in HYBRIDS],
)
def test_context_parallelism(world, family, degrees):
    """The GDN layers' sequence split with the attention's (zigzag; under Ulysses too,
    each layer's mode chosen by bytes: the head exchange at these lengths)."""
    assert len(set(world(4).run(_run, family, 9, degrees))) == 1


def test_context_parallelism_over_packed_documents(world):
    """Documents straddling the ranks' spans (`SPANS`) at TP2 x CP2: no state crosses a
    document, every state crosses the ranks."""
    assert len(set(world(4).run(_run, "qwen3_5_text", 10, dict(tp=2, cp=2), True))) == 1


def test_check_dims_takes_any_split_and_refuses_k_heads_off_tp():
    config = _model("qwen3_next", 0).config
    check_dims(config, 2, 2, tp=4)  # a sequence split: taken
    with pytest.raises(
        ValueError, match=r"n_k_heads \(4\) is not divisible by the TP degree \(8\)"
    ) as e:
        check_dims(config, 1, tp=8)
    with pytest.raises(ValueError) as planned:
        check_heads(plan.from_hf_config(config), fp.ParallelDims(tp=8))
    assert str(planned.value).startswith(str(e.value).split(" (n_v_heads")[0])


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_save_pretrained_writes_the_original_checkpoint(tmp_path, family):
    """The converted model exported (`dense_gdn` puts the GDN's sections back in the
    family's layout) loads as the original, every tensor equal, the same logits."""
    model = _model(family, 7)
    original = copy.deepcopy(model)
    hf.parallelize(model, None)
    model.save_pretrained(tmp_path / "out")
    loaded = _check_export(tmp_path / "out", original)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, original(input_ids=ids).logits)


def test_a_gated_deltanet_with_a_bias_is_refused():
    """Checked for every layer before anything is built (no family has one)."""
    model = _model("qwen3_5_text", 0)
    gdn = model.model.layers[0].linear_attn
    gdn.in_proj_z = torch.nn.Linear(gdn.hidden_size, gdn.value_dim, bias=True)
    with pytest.raises(ValueError, match=r"layer 0: a Gated DeltaNet projection or conv with"):
        hf.parallelize(model, None)


def test_tp4_olmo_hybrid_replicates_the_two_kv_heads(world, tmp_path):
    """OLMo Hybrid at TP4 over 2 KV heads: its full-width q/k norms' statistics over
    every rank's heads, each KV head (and its k norm's weight) on 2 ranks; exported,
    gathered back into OLMo Hybrid's checkpoint."""
    results = world(4).run(_run, "olmo_hybrid", 8, dict(tp=4), False, str(tmp_path / "out"))
    assert len(set(results)) == 1
