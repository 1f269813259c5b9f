"""A Hugging Face model converted by `parallelize` and cut by `fp.pipeline.split` (its
decoder run as `hf_pipeline.DecoderStages`) at PP2 x TP2 on 4 gloo ranks trains one
step like the original: the loss and every parameter gradient against float64 within
the tolerance rule, with tied embeddings (summed over the pipeline ranks), learned
positions, soft-capped logits, MoE layers and packed documents."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.pipeline import SCHEDULES, stage_losses_total
from fusedpar.testing import assert_close, exception_of
from tests.pipeline.helpers import _assert_equal, _gathered, _union

hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.support.hf_grads import reference_grad  # noqa: E402
from tests.support.hf_models import DOCUMENTS, MOE, SEQ, SPANS, VOCAB  # noqa: E402
from tests.support.hf_models import tiny_model as _model  # noqa: E402

PASSED = r" \(ranks [0-9, ]+ passed their checks; every rank raises this\)$"
STEP_REFUSALS = [  # (rank, the change to its step, the error every rank raises)
    (0, "offset positions", r"^rank 0: position_ids must be 0\.\.S-1, or restart at 0 at each "),
    (3, "positions a list", r"^rank 3: position_ids must be a torch\.Tensor or None, got list"),
    (1, "15 tokens", r"^rank 1: the batch's 15 tokens do not split into its shards: "),
]


def _step_refusals(pipe, ids, labels, kwargs) -> list:
    """Steps that one rank's own checks refuse, at the first step (`STEP_REFUSALS`): what
    each raised here, as (type, message)."""
    raised = []
    for rank, change, _ in STEP_REFUSALS:
        given, wrong = ids, dict(kwargs)
        if dist.get_rank() == rank:
            if change == "offset positions":
                wrong["position_ids"] = kwargs["position_ids"] + 3
            elif change == "positions a list":
                wrong["position_ids"] = kwargs["position_ids"].tolist()
            else:
                given = ids[:, :15]
        e = exception_of(pipe.step, given, target=labels, **wrong)
        raised.append(e and (type(e).__name__, str(e)))
    return raised


def _run(family: str, schedule: str, packed: bool = False, seed: int = 0, refusals=False):
    """One step of `family` against the original's (and with `refusals`, before it, the
    steps one rank refuses alone: what they raised is returned). At PP2 x TP2, but
    gemma2's at PP2 x CP2: its MLPs one op each on one TP rank, which swaps its DTensor
    parameters in its own node (`fusedpar.local_params.take_locals`), under the split
    backward."""
    moe = family in MOE
    tp = 1 if family == "gemma2" else 2
    dims = fp.ParallelDims(pp=2, cp=2 // tp, tp=tp, ep="tp" if moe else None)
    layers = 2 if SCHEDULES[schedule] == "single" else 4  # a stage a layer
    microbatches = layers  # one sequence each, one per stage
    model = _model(family, seed, num_hidden_layers=layers)
    refs = {torch.float64: copy.deepcopy(model).double(), torch.float32: copy.deepcopy(model)}
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (microbatches, SEQ), generator=gen)
    labels, kwargs, spans = ids.clone(), {}, [(0, SEQ)]
    if packed:  # each microbatch: documents packed as Hugging Face's collator does
        spans = SPANS
        kwargs["position_ids"] = torch.cat([torch.arange(e - s) for s, e in spans])
        kwargs["position_ids"] = kwargs["position_ids"].expand(microbatches, SEQ)
        labels[:, DOCUMENTS[:-1]] = -100  # no document predicts the next one's first token
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    losses = {}
    for dtype, ref in refs.items():  # every document alone
        logits = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in spans], dim=1)
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
        loss.backward()  # the microbatches hold as many labels: the mean of their means
        losses[dtype] = loss.detach().reshape(1)

    mesh = hf.parallelize(model, dims)
    pipe = fp.pipeline.split(model, dims, mesh, schedule=schedule, microbatches=microbatches)
    raised = _step_refusals(pipe, ids, labels, kwargs) if refusals else []
    total = stage_losses_total(pipe.step(ids, target=labels, **kwargs))
    dist.all_reduce(total)  # the last stage's TP ranks hold a share each
    assert_close(total.reshape(1), losses[torch.float64], losses[torch.float32], name="loss")
    names = []
    for name, param in pipe.model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype], name) for dtype in refs)
        assert_close(param.grad.full_tensor(), ref64, ref32, name=name, sum_length=SEQ)
        names.append(name)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    assert {name for name, _ in model.named_parameters()} <= set().union(*map(set, gathered))
    return raised


@pytest.mark.parametrize(
    "family, schedule, packed",
    [
        ("llama", "1F1B", False),
        ("llama", "Interleaved1F1B", True),  # two stages per rank, RoPE restarting per document
        ("gpt2", "1F1B", True),  # tied embeddings across the pipeline, learned positions
        ("gemma2", "InterleavedZeroBubble", False),  # tied, split backward, soft caps; CP2
        ("mixtral", "GPipe", False),  # MoE, EP over tp
        ("qwen3_moe", "1F1B", True),  # MoE and dense layers, q/k norms, packed documents
        ("deepseek_v3", "Interleaved1F1B", False),  # latent attention, the grouped router
        ("glm4_moe", "1F1B", False),  # a dense stage, then the grouped router's
        ("minimax_m2", "GPipe", False),  # full-width q/k norms, the block's correction bias
        ("olmo3", "1F1B", False),  # windows and RoPE per layer type across stages
        ("smollm3", "1F1B", True),  # a NoPE stage, packed documents
        ("gpt_neox", "DualPipeV", False),  # its own tree; fused qkv, parallel residual
    ],
)
def test_a_converted_model_pipelines_like_the_original(world, family, schedule, packed):
    """(Before llama's interleaved step: one rank's position_ids with an offset, or a
    list, or its input of another length, at the first step; the same error on every
    rank, where the other stages would wait in the schedule.)"""
    refusals = (family, schedule) == ("llama", "Interleaved1F1B")
    results = world(4).run(_run, family, schedule, packed, refusals=refusals, timeout=240)
    assert all(raised == results[0] for raised in results)
    assert len(results[0]) == (len(STEP_REFUSALS) if refusals else 0)
    for (_, change, match), (kind, message) in zip(STEP_REFUSALS, results[0], strict=False):
        want = "TypeError" if change == "positions a list" else "ValueError"
        assert kind == want and re.search(match + ".*" + PASSED, message), (change, message)


def _refused(family, schedule, batch):
    dims = fp.ParallelDims(pp=2, tp=2)
    model = _model(family, 0, num_hidden_layers=4)
    mesh = hf.parallelize(model, dims, batch=batch)
    fp.pipeline.split(model, dims, mesh, schedule=schedule)


@pytest.mark.parametrize(
    "family, schedule, batch, match",
    [
        ("llama", "1F1B", "local", r"takes the whole batch: parallelize it with batch='full'"),
        ("gpt2", "ZBVZeroBubble", "full", r"untie the embeddings"),  # measured wrong in torch
    ],
)
def test_what_a_pipeline_would_get_wrong_is_refused(world, family, schedule, batch, match):
    for e in world(4).run(exception_of, _refused, family, schedule, batch):
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def _save_or_load(degrees, save_to=None, load_from=None, schedule="1F1B", family="gpt2"):
    """`family` (GPT-2: tied embeddings) at `degrees`: one AdamW step, or a checkpoint
    loaded; then saved. This rank's parameters and moments, as full tensors."""
    dims = fp.ParallelDims(**degrees, ep="tp" if family in MOE else None)
    stages = 2 if SCHEDULES[schedule] == "single" else 4
    model = _model(family, 0, num_hidden_layers=stages)
    mesh = hf.parallelize(model, dims)
    ids = torch.randint(0, VOCAB, (stages, SEQ), generator=torch.Generator().manual_seed(1))
    if dims.pp > 1:
        pipe = fp.pipeline.split(model, dims, mesh, schedule=schedule)
        model = pipe.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if load_from is not None:
        fp.checkpoint.load(load_from, model, optimizer)
    elif dims.pp > 1:
        pipe.step(ids, target=ids)
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    if load_from is None:
        optimizer.step()
    if save_to is not None:
        fp.checkpoint.save(save_to, model, optimizer)
    return _gathered(model, optimizer)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_checkpoints_reshard_between_pipeline_layouts_bitwise(world, tmp_path, schedule):
    """PP2 x TP2 -> CP2 x TP2 -> PP2 x TP2: the tied weight and its moments under the
    unsplit model's one name, whichever stage's ranks save them (under Interleaved1F1B
    the last stage's rank also holds a middle one)."""
    pp2, pp1 = dict(pp=2, tp=2), dict(cp=2, tp=2)
    first, second = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    trained = _union(world(4).run(_save_or_load, pp2, first, None, schedule))
    assert "transformer.wte.weight.exp_avg" in trained and "lm_head.weight" not in trained
    _assert_equal(world(4).run(_save_or_load, pp1, second, first, schedule)[0], trained)
    _assert_equal(_union(world(4).run(_save_or_load, pp2, None, second, schedule)), trained)


def test_a_deepseek_v3_checkpoint_reshards_bitwise(world, tmp_path):
    """DeepSeek-V3 from PP2 x TP2 to CP2 x TP2, experts over tp: the latent attention's
    projections (whole latents, heads split) and the experts, with their moments, under
    the converted model's names whatever the layout."""
    first, second = str(tmp_path / "pp2"), str(tmp_path / "cp2")
    trained = _union(
        world(4).run(_save_or_load, dict(pp=2, tp=2), first, None, "1F1B", "deepseek_v3")
    )
    assert any(name.endswith("kv_a_weight.exp_avg") for name in trained)
    _assert_equal(
        world(4).run(_save_or_load, dict(cp=2, tp=2), second, first, "1F1B", "deepseek_v3")[0],
        trained,
    )
