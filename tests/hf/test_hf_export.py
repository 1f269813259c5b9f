"""`fusedpar.integrations.hf.save_pretrained` (and ``model.save_pretrained`` of a
converted model): a `parallelize`d Hugging Face model written back as the original's
checkpoint. ``from_pretrained`` of it gives the original's every tensor and logits bit
for bit in fp32: every family in one process; on 4 gloo ranks every family at TP2 x CP2
(experts over tp) and at PP2 x TP2 (each rank its stages' parameters), and gpt-oss at
DP2 x TP2 under FSDP2, rank 0 writing, there after every parameter the ranks hold was
doubled (so that a stale copy, a shard taken twice or an unsharded leftover shows).
What it cannot take is refused, on every rank where ranks are involved, and what fails
on a rank that converts or writes (an inverse, rank 0's write) is raised on every rank."""

import contextlib
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing import WorldError, exception_of

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")
families = pytest.importorskip("fusedpar.integrations.hf_families")

from tests.support.hf_models import FAMILIES, MOE, SEQ, VOCAB, tiny_model  # noqa: E402

# the loader's choice, not the checkpoint's (as attn_implementation): the reference's
LOAD = dict(experts_implementation="eager")


def _doubled(model):
    """A copy of `model` with every parameter doubled (buffers as they are)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for param in twin.parameters():
            param.mul_(2)
    return twin


def _check_export(directory, expected, auto="AutoModelForCausalLM") -> bool:
    """The checkpoint in `directory` loads as `expected`'s class and config (use_cache
    as the original's), every tensor equal, and gives its logits bit for bit."""
    loaded = getattr(transformers, auto).from_pretrained(directory, **LOAD)
    assert type(loaded) is type(expected)
    assert loaded.config.use_cache == expected.config.use_cache
    got, want = loaded.state_dict(), expected.state_dict()
    assert sorted(got) == sorted(want)
    unequal = [name for name in want if not torch.equal(got[name], want[name])]
    assert not unequal, unequal
    ids = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # (both in eval mode: a classifier's dropout)
        assert torch.equal(loaded(input_ids=ids).logits, expected.eval()(input_ids=ids).logits)
    return True


VARIANTS = [(family, {}) for family in FAMILIES] + [
    ("llama", dict(tie_word_embeddings=True, use_cache=False)),  # tied; use_cache kept False
]


@pytest.mark.parametrize("family, changes", VARIANTS)
def test_a_converted_family_exports_bit_for_bit_in_one_process(tmp_path, family, changes):
    model = tiny_model(family, 0, **changes)
    original = copy.deepcopy(model)
    hf.parallelize(model, None)
    assert model.config.use_cache is False  # parallelize's, for training
    model.save_pretrained(tmp_path / "out")  # the method parallelize installed
    assert _check_export(tmp_path / "out", original)


@pytest.mark.parametrize(
    "family, head, auto",
    [
        ("llama", "ForSequenceClassification", "AutoModelForSequenceClassification"),
        ("qwen2_moe", "ForTokenClassification", "AutoModelForTokenClassification"),
    ],
)
def test_the_classification_heads_export(tmp_path, family, head, auto):
    model = tiny_model(family, 0, head, pad_token_id=0, num_labels=3)
    original = copy.deepcopy(model)
    hf.parallelize(model, None)
    hf.save_pretrained(model, tmp_path / "out")
    assert _check_export(tmp_path / "out", original, auto)


def test_shards_and_a_second_save_into_the_same_directory(tmp_path):
    """``max_shard_size`` shards it (an index beside); a second save into the directory
    replaces the first's shards, none left behind."""
    model = tiny_model("qwen3", 0)
    original = copy.deepcopy(model)
    hf.parallelize(model, None)
    target = tmp_path / "out"
    hf.save_pretrained(model, target, max_shard_size="8KB")
    first = sorted(p.name for p in target.iterdir())
    assert "model.safetensors.index.json" in first and len(first) > 4
    assert _check_export(target, original)
    model.save_pretrained(target)  # one file now
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert _check_export(target, original)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize(
    "call, error, match",
    [
        (dict(state_dict={}), TypeError, r"not state_dict \(it gathers the weights itself"),
        (dict(push_to_hub=True), TypeError, r"not push_to_hub"),
        (dict(safe_serialization=False), ValueError, r"writes safetensors only"),
    ],
)
def test_what_the_method_does_not_take_is_refused(tmp_path, call, error, match):
    model = tiny_model("llama", 0)
    hf.parallelize(model, None)
    with pytest.raises(error, match=match):
        model.save_pretrained(tmp_path / "out", **call)
    assert not (tmp_path / "out").exists()


def test_an_unconverted_model_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"converted by fusedpar.integrations.hf.parallelize"):
        hf.save_pretrained(tiny_model("llama", 0), tmp_path / "out")


def _export(family: str, degrees: dict, directory: str, fsdp: bool = False) -> torch.nn.Module:
    """`family` at `degrees` (experts over tp for the MoE families; FSDP2 over dp with
    `fsdp`; under pp the pipeline of `fp.pipeline.split`), every parameter a rank holds
    doubled in place, then exported into `directory`; returns the original doubled.
    Under pp, first: the model alone (no pipeline=) is refused on every rank."""
    dims = fp.ParallelDims(**degrees, ep="tp" if family in MOE else None)
    model = tiny_model(family, 0, num_hidden_layers=2)
    expected = _doubled(model)
    mesh = hf.parallelize(model, dims)
    held, pipeline = model, None
    if dims.pp > 1:
        pipeline = fp.pipeline.split(model, dims, mesh, schedule="1F1B")
        held = pipeline.model
        error = exception_of(hf.save_pretrained, model, directory)
        assert isinstance(error, ValueError) and "pipeline=pipe" in str(error), repr(error)
    if fsdp:
        for layer in model.model.layers:
            dims.fully_shard(layer, mesh)
        dims.fully_shard(model, mesh)
    with torch.no_grad():
        for param in held.parameters():
            param.to_local().mul_(2)  # this rank's part: shards, replicas, its stages only
    hf.save_pretrained(model, directory, pipeline=pipeline)
    assert os.path.isfile(os.path.join(directory, "config.json"))  # on every rank, once back
    return expected


def _export_each(degrees: dict, directory: str, families: list, fsdp: bool = False) -> list:
    """Each of `families` exported at `degrees` into directory/family (`_export`), then
    the checkpoints checked, family i by rank i mod 4 (the ranks share the checks; every
    checkpoint is complete by then): the families this rank checked."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for i, family in enumerate(families):
        expected = _export(family, degrees, os.path.join(directory, family), fsdp)
        if i % world == rank:
            mine[family] = expected
    for family, expected in mine.items():
        assert _check_export(os.path.join(directory, family), expected), family
    return list(mine)


# every family from each layout (one World call a layout: a call a family costs its
# scheduling); every family's tiny config runs both (none to leave out)
LAYOUTS = {"TP2 x CP2, EP over tp": dict(cp=2, tp=2), "PP2 x TP2": dict(pp=2, tp=2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_family_exports_from_each_layout(world, tmp_path, layout):
    """TP2 x CP2 (latent attention's heads, the experts over tp) and PP2 x TP2 (each
    rank its stage's parameters; GPT-2's, Gemma's and SmolLM3's embeddings tied across
    the stages): every rank contributes, rank 0 writes, every checkpoint loads as the
    doubled original."""
    checked = world(4).run(_export_each, LAYOUTS[layout], str(tmp_path), list(FAMILIES))
    assert sorted(sum(checked, [])) == sorted(FAMILIES)


def test_fsdp2_shards_are_gathered(world, tmp_path):
    """gpt-oss at DP2 x TP2 under FSDP2 over dp (sinks, interleaved experts, EP over tp)."""
    checked = world(4).run(_export_each, dict(dp=2, tp=2), str(tmp_path), ["gpt_oss"], True)
    assert sum(checked, []) == ["gpt_oss"]


def _alone(directory: str) -> None:
    """Rank 0 alone calls it (the single-process habit): it fails waiting for the others.
    The 1 s wait is rank 0's, for this call only: the ranks live on for other tests."""
    model = tiny_model("llama", 0)
    hf.parallelize(model, fp.ParallelDims(dp=2, tp=2))
    if dist.get_rank() == 0:
        os.environ["FUSEDPAR_CHECKPOINT_TIMEOUT_S"] = "1"
        try:
            model.save_pretrained(directory)
        finally:
            del os.environ["FUSEDPAR_CHECKPOINT_TIMEOUT_S"]


def test_a_rank_calling_alone_raises_instead_of_waiting(world, tmp_path):
    with pytest.raises(WorldError) as raised:
        world(4).run(_alone, str(tmp_path / "out"))
    error = raised.value.exceptions[0]
    assert re.search(r"is collective: ranks 1, 2, 3 of 4 did not call it within 1 s", str(error))
    assert not (tmp_path / "out").exists()


@contextlib.contextmanager
def _failing_inverse(rank: int):
    """On `rank`: Hugging Face's MLP inverse raises a KeyError (as a missing name would);
    restored after (the World's ranks live on)."""
    real = families.dense_mlp

    def broken(template, config, params):
        if dist.get_rank() == rank:
            raise KeyError("gate_proj.weight")
        return real(template, config, params)

    families.dense_mlp = broken
    try:
        yield
    finally:
        families.dense_mlp = real


def _failures(directory: str) -> list:
    """What three saves raised on this rank: at DP2 x TP2 rank 0's inverse failing, at
    PP2 x TP2 that of rank 2 (the lowest of the second stage, which sends it), then rank
    0's write (the target is a file)."""
    raised = []
    model = tiny_model("llama", 0)
    dims = fp.ParallelDims(dp=2, tp=2)
    hf.parallelize(model, dims)
    with _failing_inverse(0):
        raised.append(exception_of(hf.save_pretrained, model, os.path.join(directory, "dp")))
    model = tiny_model("llama", 0, num_hidden_layers=2)
    staged = fp.ParallelDims(pp=2, tp=2)
    pipeline = fp.pipeline.split(model, staged, hf.parallelize(model, staged))
    with _failing_inverse(2):
        target = os.path.join(directory, "pp")
        raised.append(exception_of(hf.save_pretrained, model, target, pipeline=pipeline))
    model = tiny_model("llama", 0)
    hf.parallelize(model, dims)
    path = os.path.join(directory, "file")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write("not a directory")
    raised.append(exception_of(hf.save_pretrained, model, path))
    return raised


INVERSE = r"^rank {}: save_pretrained: model\.layers\.{}\.mlp \(\w+\) does not convert back: "
FAILED = [  # each save's error, on every rank
    (KeyError, INVERSE.format(0, 0) + r"gate_proj\.weight$"),
    (KeyError, INVERSE.format(2, 1) + r"gate_proj\.weight$"),
    (ValueError, r"^rank 0: .* is a file"),
]


def test_what_fails_on_a_writing_rank_raises_on_every_rank(world, tmp_path):
    """A rank that keeps full tensors fails: rank 0's inverse of a converted layer, a
    stage's under pp (while the other ranks go on gathering), rank 0's write (here the
    target is a file): the same error on every rank, none left waiting (a short
    timeout), nothing written."""
    results = world(4).run(_failures, str(tmp_path), timeout=120)
    for raised in results:
        for e, (kind, match) in zip(raised, FAILED, strict=True):
            assert type(e) is kind and re.search(match, e.args[0]), repr(e)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no directory, no staging
