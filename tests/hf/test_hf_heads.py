"""`parallelize` on the heads users fine-tune: `*ForSequenceClassification` (pooled at each
row's last real token, wherever it lives; each of Hugging Face's problem types) and
`*ForTokenClassification` (unshifted labels, -100 ignored), on right-padded batches whose
rows end on different ranks, at TP2 x CP2 (and CP2 x Ulysses 2) and in one process: the
logits, the loss and every parameter gradient against Hugging Face's model in float64;
and what these heads cannot take, refused on every rank before any collective."""

import copy
import re

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing import assert_close, exception_of

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.support.hf_grads import reference_grad  # noqa: E402
from tests.support.hf_models import COMMON, FAMILIES, MOE, NO_GQA, SEQ, VOCAB  # noqa: E402

PAD = 0
# real tokens per row: at TP2 x CP2 (zigzag chunks of 4 tokens, then TP halves) the rows'
# last real tokens (15, 10, 5, 2) live on four different ranks
LENGTHS = (16, 11, 6, 3)
HEADS = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}
PROBLEMS = {  # name: num_labels, config.problem_type (None: inferred as Hugging Face does)
    "regression (inferred: one label)": (1, None),
    "single label (inferred: integer labels)": (3, None),
    "multi label (inferred: float labels)": (3, None),
    "regression of 3 outputs (set)": (3, "regression"),
}


def _model(family: str, head: str, seed: int, **changes):
    """A tiny random `family` model with `head`, every parameter re-drawn."""
    config_cls, _, options = FAMILIES[family]
    common = {k: v for k, v in COMMON.items() if family not in NO_GQA or "key_value" not in k}
    fields = {**common, **options, "pad_token_id": PAD, "classifier_dropout": 0.0, **changes}
    config = getattr(transformers, config_cls)(**fields, experts_implementation="eager")
    torch.manual_seed(seed)
    model_cls = getattr(transformers, config_cls.removesuffix("Config") + HEADS[head])
    model = model_cls(config).float()
    with torch.no_grad():  # Hugging Face's init zeroes biases and sets norms to 1: re-draw
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def _batch(head: str, problem: str | None, seed: int, num_labels: int):
    """input_ids (B, S) right-padded to LENGTHS, its mask, and labels for `head`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate(LENGTHS):
        ids[row, length:], mask[row, length:] = PAD, 0
    ids[1, LENGTHS[1] - 1] = PAD  # a pad id among real tokens: pooled before it (Hugging Face)
    rows = len(LENGTHS)
    if head == "token":
        labels = torch.randint(0, num_labels, ids.shape, generator=g)
        labels[mask == 0] = -100
        labels[0, 3] = labels[2, 1] = -100  # ignored real tokens too
    elif problem.startswith("single"):
        labels = torch.randint(0, num_labels, (rows,), generator=g)
    elif problem.startswith("multi"):
        labels = torch.randint(0, 2, (rows, num_labels), generator=g).float()
    else:  # regression
        labels = torch.randn(rows, num_labels, generator=g).squeeze(-1)
    return ids, mask, labels


def _run_head(head: str, family: str, seed: int, problem: str | None = None, degrees=None):
    """At TP2 x CP2 on 4 ranks (or `degrees`); in one process with every group None.
    Returns what must be the same on every rank: the loss and the pooled logits."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    moe = family in MOE
    dims = fp.ParallelDims(**(degrees or dict(cp=2, tp=2)), ep="tp" if moe else None)
    dims = dims if world == 4 else None
    num_labels, problem_type = PROBLEMS[problem] if head == "sequence" else (5, None)
    model = _model(family, head, seed, num_labels=num_labels, problem_type=problem_type)
    ids, mask, labels = _batch(head, problem, seed, num_labels)
    real = mask.bool()
    refs = {torch.float64: copy.deepcopy(model).double(), torch.float32: copy.deepcopy(model)}
    out = {}
    for dtype, ref in refs.items():
        given = labels.to(dtype) if labels.is_floating_point() else labels
        result = ref(input_ids=ids, attention_mask=mask, labels=given)
        result.loss.backward()
        logits = result.logits.detach()
        out[dtype] = (logits[real] if head == "token" else logits, result.loss.detach())

    mesh = hf.parallelize(model, dims)
    groups = dims.groups(mesh) if dims else dict.fromkeys(("cp", "ulysses", "tp"))
    result = model(input_ids=ids, attention_mask=mask, labels=labels)
    result.loss.backward()
    logits = result.logits.detach()
    if head == "token":  # this rank's tokens'; the padded positions' are not Hugging Face's
        logits = hf.full_logits(logits, groups)[real]
    assert_close(logits, *(out[dtype][0] for dtype in refs), name="logits")
    assert_close(result.loss.detach(), *(out[dtype][1] for dtype in refs), name="loss")
    for name, param in model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype], name) for dtype in refs)
        grad = param.grad.full_tensor() if dims else param.grad
        assert_close(grad, ref64, ref32, name=name, sum_length=SEQ)
    same = result.logits.detach() if head == "sequence" else result.loss.detach()
    return (result.loss.item(), *same.flatten().tolist())


DISTRIBUTED = [  # the problem types differ in Hugging Face's loss of the pooled logits only
    ("sequence", "llama", 0, "multi label (inferred: float labels)"),
    ("sequence", "llama", 1, "regression (inferred: one label)", dict(cp=2, ulysses=2)),
    ("token", "llama", 2),
]


def _run_cases(cases):
    return [_run_head(*case) for case in cases]


def test_the_heads_at_tp2_cp2(world):
    """Every case on the same ranks in one call; each rank's loss and pooled logits alike."""
    results = world(4).run(_run_cases, DISTRIBUTED)
    assert all(len({rank[i] for rank in results}) == 1 for i in range(len(DISTRIBUTED)))


@pytest.mark.parametrize(
    "head, family, problem",
    [
        *(("sequence", "llama", problem) for problem in PROBLEMS),
        ("sequence", "gpt2", "single label (inferred: integer labels)"),  # its own head code
        ("sequence", "gpt_neox", "multi label (inferred: float labels)"),  # its own head code
        ("sequence", "mixtral", "regression (inferred: one label)"),  # MoE
        ("sequence", "olmo2", "single label (inferred: integer labels)"),  # full-width q/k norms
        ("token", "gpt2", None),  # its own head: `classifier`
        ("token", "qwen3", None),  # q/k norms
    ],
)
def test_the_heads_in_one_process(head, family, problem):
    assert _run_head(head, family, 3, problem)


def test_one_row_without_a_pad_token_pools_the_last_token():
    """Hugging Face's rule without config.pad_token_id: the last token of a batch of one."""
    model = _model("llama", "sequence", 4, pad_token_id=None, num_labels=2)
    ids = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
    expected = copy.deepcopy(model)(input_ids=ids, labels=torch.tensor([1]))
    hf.parallelize(model, None)
    got = model(input_ids=ids, labels=torch.tensor([1]))
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)


def _refused_head(model_name: str):
    config = transformers.LlamaConfig(**COMMON)
    hf.parallelize(getattr(transformers, model_name)(config), fp.ParallelDims(cp=2, tp=2))


@pytest.mark.parametrize("model_name", ["LlamaForQuestionAnswering", "LlamaModel"])
def test_another_head_is_refused_on_every_rank(world, model_name):
    for e in world(4).run(exception_of, _refused_head, model_name):
        assert isinstance(e, ValueError), repr(e)
        assert re.search(
            rf"{model_name}'s head is not supported \(supported: \*ForCausalLM, "
            r"\*ForSequenceClassification, \*ForTokenClassification\)",
            str(e),
        ), str(e)


def _padded(rows):
    """ids and mask of `rows` (B, S) of 1 (real) / 0 (pad)."""
    mask = torch.tensor(rows).repeat_interleave(SEQ // len(rows[0]), dim=1)
    ids = torch.where(mask.bool(), torch.arange(1, SEQ + 1) % VOCAB, PAD)
    return ids, mask


RIGHT, LEFT = [[1, 1, 1, 0], [1, 1, 1, 1]], [[0, 1, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize(
    "head, call, match",
    [
        (
            "sequence",
            lambda: dict(zip(("input_ids", "attention_mask"), _padded(LEFT), strict=True)),
            r"only right padding is taken",
        ),
        (
            "sequence",
            lambda: dict(
                zip(
                    ("input_ids", "attention_mask"),
                    _padded([[0, 0, 0, 0], [1, 1, 1, 1]]),
                    strict=True,
                )
            ),
            r"rows \[0\] have no real token",
        ),
        (
            "sequence",
            lambda: dict(
                input_ids=_padded(RIGHT)[0].clamp(min=1),  # pads not PAD
                attention_mask=_padded(RIGHT)[1],
            ),
            r"rows \[0\]: the token sequence classification pools at .* "
            "is padding by attention_mask",
        ),
        (
            "sequence",
            lambda: dict(input_ids=_padded(RIGHT)[0], labels=torch.zeros(3)),
            r"labels must be one per row, \(B,\) or \(B, num_labels\) with B = 2, got \(3,\)",
        ),
        (
            "token",
            lambda: dict(
                zip(("input_ids", "attention_mask"), _padded(RIGHT), strict=True),
                labels=torch.zeros(2, SEQ, dtype=torch.long),
            ),
            r"labels must be -100 at the padded positions",
        ),
        (
            "token",
            lambda: dict(input_ids=_padded(RIGHT)[0], shift_labels=_padded(RIGHT)[0]),
            r"shift_labels are a causal LM's",
        ),
    ],
)
def test_what_the_heads_would_get_wrong_is_refused(head, call, match):
    model = _model("llama", head, 0, num_labels=2)
    hf.parallelize(model, None)
    with pytest.raises(ValueError, match=match):
        model(**call())


def test_padding_with_packed_documents_is_refused():
    model = _model("llama", "token", 0, num_labels=2)
    hf.parallelize(model, None)
    ids, mask = _padded([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"padding .* and packed documents .* not supported"):
        model(input_ids=ids, attention_mask=mask, position_ids=(torch.arange(SEQ) % 8)[None])


def test_pooling_without_the_whole_batch_is_refused():
    with pytest.raises(ValueError, match=r"with batch='local' \(pooling reads the whole"):
        hf.parallelize(_model("llama", "sequence", 0), None, batch="local")
    model = _model("llama", "sequence", 0, pad_token_id=None)
    hf.parallelize(model, None)
    with pytest.raises(ValueError, match=r"a batch of 2 rows needs config.pad_token_id"):
        model(input_ids=torch.ones(2, SEQ, dtype=torch.long))


@pytest.mark.parametrize("head", list(HEADS))
def test_a_classifier_under_pipeline_parallelism_is_refused(head):
    with pytest.raises(ValueError, match=r"under pipeline parallelism \(pp=2; a causal LM's"):
        hf.parallelize(_model("llama", head, 0), fp.ParallelDims(pp=2))
