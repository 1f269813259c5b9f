"""`fusedpar.integrations.hf.parallelize` on tiny random Hugging Face models of every
supported family (built from their configs, nothing downloaded, fp32): at TP2 x CP2 (EP
over tp for the MoE families) and in one process with every group None, the converted
model gives the original's
logits, loss and every parameter gradient (gathered) within the tolerance rule; each
unsupported option is refused, on every rank, before any collective; and a call one
rank refuses alone is the same ValueError on every rank. (Its compile:
tests/hf/test_hf_compile.py.)"""

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fusedpar as fp
from fusedpar.testing import assert_close, assert_ulps, exception_of

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
hf = pytest.importorskip("fusedpar.integrations.hf")

# the tiny models of every family and their batches (shared with the other test_hf*
# modules), the gradients they are held against
from tests.support.hf_grads import reference_grad  # noqa: E402
from tests.support.hf_models import (  # noqa: E402
    BATCH,
    DOCUMENTS,
    FAMILIES,
    MOE,
    PADDED,
    SEQ,
    SPANS,
    VOCAB,
)
from tests.support.hf_models import tiny_model as _model  # noqa: E402


def _run_family(family, seed, changes=None, batch="full", degrees=None, overlap=None):
    """At TP2 x CP2 on 4 ranks (or the `degrees` of ParallelDims given); in one process
    (no torch.distributed) with every group None and plain parameters. `changes`: config
    fields over the family's. `batch`: "full", the model takes the whole batch and
    labels= (Hugging Face's way); "local", this rank's tokens and a loss of the
    caller's. `overlap`: the TP projections' schedule (`parallelize`'s)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    moe = family in MOE
    degrees = degrees or dict(cp=2, tp=2)
    degrees = {"ep": "tp" if moe else None, **degrees}  # (`degrees` may name ep)
    dims = fp.ParallelDims(**degrees) if world == 4 else None
    model = _model(family, seed, **(changes or {}))
    refs = {torch.float64: copy.deepcopy(model).double(), torch.float32: copy.deepcopy(model)}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = hf.next_token_labels(ids)
    valid = int((labels != -100).sum())
    out = {}
    for dtype, ref in refs.items():
        logits = ref(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / valid
        loss.backward()
        out[dtype] = (logits.detach(), loss.detach().reshape(1))

    mesh = hf.parallelize(model, dims, batch=batch, overlap=overlap)
    scheduled = [m.overlap for m in model.modules() if hasattr(m, "overlap")]
    assert scheduled and set(scheduled) == {overlap}  # every TP projection takes it
    groups = dims.groups(mesh) if dims else dict.fromkeys(("cp", "ulysses", "tp"))
    if batch == "full":  # every rank: the whole batch, the original's loss
        result = model(input_ids=ids, labels=ids)
        logits, total = result.logits, result.loss.detach().reshape(1)
        result.loss.backward()
    else:
        logits = model(input_ids=hf.local_tokens(ids, groups)).logits  # (B, S/CP/TP, V)
        local = hf.local_tokens(labels, groups).flatten()
        loss = F.cross_entropy(logits.flatten(0, 1), local, reduction="sum") / valid
        loss.backward()
        total = loss.detach().clone().reshape(1)
        if world > 1:
            dist.all_reduce(total)
    full = hf.full_logits(logits.detach(), groups)
    assert_close(full, out[torch.float64][0], out[torch.float32][0], name="logits")
    assert_close(total, out[torch.float64][1], out[torch.float32][1], name="loss")
    checked = 0
    for name, param in model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype], name) for dtype in refs)
        grad = param.grad.full_tensor() if dims else param.grad
        assert_close(grad, ref64, ref32, name=name, sum_length=SEQ)
        checked += 1
    return checked


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_converted_model_trains_like_the_original(world, family):
    assert len(set(world(4).run(_run_family, family, 0))) == 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # SwiGLU; column and row linears
def test_a_converted_model_in_the_serial_schedule(world, family):
    """`parallelize(..., overlap="serial")`: one collective, then one GEMM, in every TP
    projection (the ring is gloo's "auto")."""
    assert len(set(world(4).run(_run_family, family, 5, None, "full", None, "serial"))) == 1


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])  # softmax; sigmoid, groups
def test_experts_over_data_parallel_ranks(world, family):
    """EP 4 over dp 2 x tp 2 (#57): the same ParallelDims for every MoE family, which
    all convert through the same layer; its router and shared experts whole."""
    degrees = dict(dp=2, tp=2, ep=("dp", "tp"))
    assert len(set(world(4).run(_run_family, family, 7, None, "full", degrees))) == 1


def _run_float64(family, seed):
    """The model in float64 at TP2 x CP2 (`labels=`, Hugging Face's way) against the
    original in float64: logits, loss and every gathered gradient to a few ulps (both
    in float64 throughout, but for the fp32 casts inside Hugging Face's own modules,
    which both sides share: its norms, its rotary tables)."""
    dims = fp.ParallelDims(cp=2, tp=2)
    model = _model(family, seed).double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = hf.next_token_labels(ids)
    logits = ref(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = loss / (labels != -100).sum()
    loss.backward()
    mesh = hf.parallelize(model, dims)
    result = model(input_ids=ids, labels=ids)
    result.loss.backward()
    full = hf.full_logits(result.logits.detach(), dims.groups(mesh))
    assert full.dtype == result.loss.dtype == torch.float64
    assert_ulps(full, logits.detach(), name="logits")
    assert_ulps(result.loss.detach().reshape(1), loss.detach().reshape(1), name="loss")
    for name, param in model.named_parameters():
        assert_ulps(param.grad.full_tensor(), reference_grad(ref, name), name=name)
    return True


def test_a_float64_model_matches_the_original_to_a_few_ulps(world):
    assert all(world(4).run(_run_float64, "llama", 4))


@pytest.mark.parametrize(
    "family, degrees",
    [
        ("llama", None),
        ("gpt2", None),  # learned positions looked up at the shards' global positions
        ("gpt2", dict(cp=2, ulysses=2)),  # ... in the hybrid's layout
    ],
)
def test_the_caller_may_shard_the_batch_itself(world, family, degrees):
    assert len(set(world(4).run(_run_family, family, 2, None, "local", degrees))) == 1


@pytest.mark.parametrize(
    "family, degrees",
    [
        ("llama", dict(ulysses=2, tp=2)),  # one q head and one (shared) kv head per rank
        ("gemma2", dict(cp=2, ulysses=2)),  # the hybrid: windows and soft-capping over both
        ("mixtral", dict(ulysses=2, tp=2)),  # experts over tp
        ("gpt_oss", dict(cp=2, ulysses=2)),  # sinks entering once, after the hybrid's merge
        ("deepseek_v3", dict(cp=2, ulysses=2)),  # latent attention's expanded heads over both
        # #43's other families, the hybrid each
        *(
            (family, dict(cp=2, ulysses=2))
            for family in ("qwen3_moe", "glm4_moe", "minimax_m2", "olmo3", "smollm3")
        ),
    ],
)
def test_ulysses_and_the_hybrid(world, family, degrees):
    assert len(set(world(4).run(_run_family, family, 3, None, "full", degrees))) == 1


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}
VARIANTS = [(family, None) for family in FAMILIES] + [
    ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),  # scaled, tied
    ("qwen2_moe", dict(num_hidden_layers=2, mlp_only_layers=[1])),  # a dense layer among MoE
    # MoE every second layer, the top-k weights not renormalized
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
    (
        "mixtral",
        dict(norm_topk_prob=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),  # Mixtral's router normalizes whatever this says
    (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=2),
    ),  # its second layer windowed
    ("phi3", dict(partial_rotary_factor=0.5, pad_token_id=0)),  # partial rotary
]


@pytest.mark.parametrize("family, changes", VARIANTS)
def test_one_process_with_every_group_none(family, changes):
    assert _run_family(family, 1, changes) > 0


def _run_packed(family, seed, degrees=None):
    """Documents packed into one sequence, as Hugging Face's flattening collator gives them
    (position_ids restarting at 0, the labels of each document's first token -100),
    against the original run on each document alone; TP2 x CP2 unless `degrees`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = fp.ParallelDims(**(degrees or dict(cp=2, tp=2))) if world == 4 else None
    model = _model(family, seed)
    refs = {torch.float64: copy.deepcopy(model).double(), torch.float32: copy.deepcopy(model)}
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(e - s) for s, e in SPANS])[None]
    labels = ids.clone()
    labels[0, DOCUMENTS[:-1]] = -100  # no document predicts the next one's first token
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    valid = int((shifted != -100).sum())
    out = {}
    for dtype, ref in refs.items():
        logits = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in SPANS], dim=1)
        loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="sum") / valid
        loss.backward()
        out[dtype] = (logits.detach(), loss.detach().reshape(1))
    mesh = hf.parallelize(model, dims)
    groups = dims.groups(mesh) if dims else dict.fromkeys(("cp", "ulysses", "tp"))
    result = model(input_ids=ids, labels=labels, position_ids=positions)
    result.loss.backward()
    assert_close(
        hf.full_logits(result.logits.detach(), groups),
        out[torch.float64][0],
        out[torch.float32][0],
        name="logits",
    )
    assert_close(
        result.loss.detach().reshape(1), out[torch.float64][1], out[torch.float32][1], name="loss"
    )
    for name, param in model.named_parameters():
        ref64, ref32 = (reference_grad(refs[dtype], name) for dtype in refs)
        grad = param.grad.full_tensor() if dims else param.grad
        assert_close(grad, ref64, ref32, name=name, sum_length=SEQ)
    return True


@pytest.mark.parametrize(
    "family, degrees",
    [
        ("llama", None),  # RoPE restarting in each document
        ("gpt2", None),  # learned positions restarting
        ("gemma2", dict(cp=2, ulysses=2)),  # windows and soft-capping, the hybrid
        ("deepseek_v3", None),  # latent attention, its rotary dims restarting
    ],
)
def test_packed_documents_attend_within_their_own(world, family, degrees):
    assert world(4).run(_run_packed, family, 4, degrees) == [True] * 4


def test_packed_documents_in_one_process():
    assert _run_packed("mistral", 5)


@pytest.mark.parametrize(
    "batch, call, match",
    [
        ("full", dict(attention_mask=PADDED), r"no padding \(attention_mask may be left out or"),
        ("full", dict(position_ids=torch.arange(SEQ)[None] + 3), r"restart at 0 at each packed"),
        ("full", dict(position_ids=torch.arange(SEQ)[None] % 8), r"take one sequence \(B = 1\)"),
        ("full", dict(labels=torch.zeros(BATCH, SEQ - 1, dtype=torch.long)), r"labels must be"),
        ("full", dict(use_cache=True), r"keeps no KV cache"),
        (
            "local",
            dict(attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long)),
            r"attention_mask=None",
        ),
        ("local", dict(position_ids=torch.arange(SEQ)[None]), r"no position_ids"),
        ("local", dict(labels=torch.zeros(BATCH, SEQ, dtype=torch.long)), r"labels= would shift"),
    ],
)
def test_what_the_converted_model_would_get_wrong_is_refused(batch, call, match):
    model = _model("llama", 0)
    hf.parallelize(model, None, batch=batch)
    with pytest.raises(ValueError, match=match):
        model(input_ids=torch.zeros(BATCH, SEQ, dtype=torch.long), **call)


def test_a_tokenizers_all_ones_mask_and_positions_are_taken():
    """batch="full": HF's own call, with the mask and positions of unpadded text, gives
    the original's loss."""
    model = _model("llama", 0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    call = dict(
        input_ids=ids,
        labels=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(SEQ)[None],
    )
    expected = copy.deepcopy(model)(**call).loss
    hf.parallelize(model, None)
    torch.testing.assert_close(model(**call).loss, expected, rtol=1e-5, atol=1e-6)


def _run_wrong_batch(case):
    """A batch that is not what the mode takes raises on every rank (TP2 x CP2)."""
    dims = fp.ParallelDims(cp=2, tp=2)
    model = _model("llama", 0)
    mesh = hf.parallelize(model, dims, batch="local" if case.startswith("local") else "full")
    groups = dims.groups(mesh)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    if case == "full: each rank its own shard":  # 4 x SEQ tokens: a shard that divides
        ids = torch.randint(0, VOCAB, (BATCH, 4 * SEQ), generator=torch.Generator().manual_seed(0))
        model(input_ids=hf.local_tokens(ids, groups))
    elif case == "full: a length that does not split":
        model(input_ids=ids[:, :-4])
    elif case == "full: a contiguous shard":
        rank = dist.get_rank()
        model(input_ids=ids.chunk(4, dim=1)[rank].repeat(1, 4))
    elif case == "full: a different batch per rank":
        model(input_ids=(ids + dist.get_rank()) % VOCAB, labels=ids)
    elif case == "local: the whole batch":
        model(input_ids=ids)
    elif case == "local: sharded over cp only":
        model(input_ids=fp.shard_sequence(ids, groups["cp"], dim=1))


@pytest.mark.parametrize(
    "case, match",
    [
        (
            "full: each rank its own shard",
            r"^batch='full': the ranks disagree: rank 1 has tokens "
            r"\(2, 16\) #[0-9a-f]{6} where rank 0 has .*The ranks of a cp x tp group got different",
        ),
        (
            "full: a length that does not split",
            r"^the batch's 12 tokens do not split.*multiple of 8$",
        ),
        ("full: a contiguous shard", r"got different batches"),
        ("full: a different batch per rank", r"rank 1 has tokens \(2, 16\) #[0-9a-f]{6} where "),
        ("local: the whole batch", r"batch='local': the ranks of mesh axis 'cp' hold the same"),
        ("local: sharded over cp only", r"the ranks of mesh axis 'tp' hold the same tokens"),
    ],
)
def test_a_batch_the_mode_does_not_take_raises_on_every_rank(world, case, match):
    import re

    for e in world(4).run(exception_of, _run_wrong_batch, case):
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def _one_rank_cases() -> dict:
    """One rank's call refused by a check it makes alone, or its batch unlike its group's,
    at the first call: TP2 x CP2 under "full" and "local", dp 4 under "full"; {case: (the
    exception's type, its message), None where the call returned}."""
    rank, out = dist.get_rank(), {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model = _model("llama", 0)
    dims = fp.ParallelDims(cp=2, tp=2)
    groups = dims.groups(hf.parallelize(model, dims))
    short = ids[:, :-1]  # 15 tokens
    full = {
        "full: a length that does not split": dict(input_ids=ids[:, : 12 if rank == 2 else SEQ]),
        "full: labels of another shape": dict(input_ids=ids, labels=short if rank == 1 else ids),
        "full: two ranks refuse": dict(input_ids=ids, use_cache=rank in (0, 3)),
        "full: input_ids a list on one rank": dict(input_ids=ids.tolist() if rank == 1 else ids),
        "full: other labels": dict(input_ids=ids, labels=(ids + (rank == 3)) % VOCAB),
        "full: a valid call after them": dict(input_ids=ids, labels=ids),
    }
    for case, call in full.items():
        out[case] = exception_of(model, **call)
    model = _model("llama", 0)
    hf.parallelize(model, dims, batch="local")
    share = hf.local_tokens(ids, groups)  # (B, 4)
    local = {
        "local: a share that does not split": dict(input_ids=share[:, : 3 if rank == 2 else 4]),
        "local: labels on one rank": dict(input_ids=share, labels=share if rank == 1 else None),
        "local: a share of another length": dict(input_ids=share.repeat(1, 1 + (rank == 2))),
    }
    for case, call in local.items():
        out[case] = exception_of(model, **call)
    model = _model("llama", 0)
    hf.parallelize(model, fp.ParallelDims(dp=4))
    out["dp 4: labels of another shape"] = exception_of(
        model, input_ids=ids, labels=short if rank == 3 else ids
    )
    return {case: e and (type(e).__name__, str(e)) for case, e in out.items()}


PASSED = r" \((ranks [0-9, ]+) passed their checks; every rank raises this\)$"
HASH = r"#[0-9a-f]{6}"  # a tensor's fingerprint, shown
ONE_RANK_CASES = {  # case: the message on every rank (None: none raised)
    "full: a length that does not split": (
        r"^rank 2: the batch's 12 tokens do not split into its shards: .* multiple of 8" + PASSED
    ),
    "full: labels of another shape": (
        r"^rank 1: labels must be \(B, S\) = \(2, 16\), like the input, got \(2, 15\)" + PASSED
    ),
    "full: two ranks refuse": (
        r"^ranks 0, 3: a model converted by fusedpar keeps no KV cache: use_cache=False" + PASSED
    ),
    "full: input_ids a list on one rank": (  # a TypeError (where every refusal is one)
        r"^rank 1: input_ids must be a torch\.Tensor or None, got list" + PASSED
    ),
    "full: other labels": (
        rf"^batch='full': the ranks disagree: rank 3 has labels \(2, 16\) {HASH} where ranks "
        rf"0, 1, 2 have labels \(2, 16\) {HASH}\. The ranks of a cp x tp group got different"
    ),
    "full: a valid call after them": None,
    "local: a share that does not split": (
        r"^rank 2: batch='local': this rank's 3 tokens \(x 4 ranks = 12\) do not split into "
        r"its shards: .*of 8" + PASSED
    ),
    "local: labels on one rank": (
        r"^rank 1: labels= would shift within each rank's shard \(batch='local'\): .*" + PASSED
    ),
    "local: a share of another length": (
        r"^batch='local': the ranks disagree: rank 2 has tokens \(2, 8\) where ranks 0, 1, 3 "
        r"have tokens \(2, 4\)"
    ),
    "dp 4: labels of another shape": (
        r"^rank 3: labels must be \(B, S\) = \(2, 16\), like the input, got \(2, 15\)" + PASSED
    ),
}


def test_one_ranks_refusal_is_the_same_error_on_every_rank(world):
    """A check that one rank fails alone (a length that does not split, labels of another
    shape, use_cache; input_ids not a tensor: a TypeError) or a batch unlike its group's,
    at the first call: the same ValueError on every rank, naming the ranks and the value,
    where the other ranks waited in the batch check's all-gather (a short timeout: a
    wait fails here)."""
    results = world(4).run(_one_rank_cases, timeout=240)
    for case, match in ONE_RANK_CASES.items():
        assert len({out[case] for out in results}) == 1, (case, [out[case] for out in results])
        if match is None:
            assert results[0][case] is None, (case, results[0][case])
            continue
        kind, message = results[0][case]
        want = "TypeError" if "a list" in case else "ValueError"
        assert kind == want and re.search(match, message), (case, message)


def _run_refusal(family, changes):
    hf.parallelize(_model(family, 0, **changes), fp.ParallelDims(cp=2, tp=2))


@pytest.mark.parametrize(
    "family, changes, match",
    [
        ("llama", dict(attention_dropout=0.1), r"attention_dropout=0.1"),
        ("llama", dict(hidden_act="relu"), r"hidden_act='relu'"),
        ("mixtral", dict(router_jitter_noise=0.1, sliding_window=None), r"router_jitter_noise=0.1"),
        ("qwen2", dict(layer_types=["chunked_attention"]), r"layer_types \['chunked_attention'\]"),
        (
            "llama",
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            r"rope_type 'dynamic'",
        ),
    ],
)
def test_unsupported_options_are_refused_on_every_rank(world, family, changes, match):
    import re

    for e in world(4).run(exception_of, _run_refusal, family, changes):
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def test_another_family_is_refused():
    config = transformers.GPTJConfig(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, rotary_dim=4)
    model = transformers.GPTJForCausalLM(config)
    with pytest.raises(ValueError, match=r"model_type 'gptj' \(supported: llama"):
        hf.parallelize(model, fp.ParallelDims())


def _batch_check_gathers(degrees: dict) -> list:
    """The all-gathers over the world (the batch check's: the layers' run on their
    groups of 2) of two forward calls of a converted Llama."""
    from fusedpar.testing.collectives import Collectives

    model = _model("llama", 0)
    hf.parallelize(model, fp.ParallelDims(**degrees))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counts = []
    for _ in range(2):
        with Collectives() as seen:
            model(input_ids=ids, labels=ids)
        counts.append(seen.counts.get(("all_gather", 4), 0))
    return counts


def test_the_batch_check_runs_at_the_first_call_only(world):
    """batch="full": the same-batch check all-gathers at the first call only (it ran at
    every step), dp 4 too (a rank's refusal stops every rank; nothing else to compare)."""
    names = {"dp": "data", "cp": "context", "tp": "tensor"}  # a mesh by other names too
    assert world(4).run(_batch_check_gathers, dict(cp=2, tp=2, names=names)) == [[1, 0]] * 4
    assert world(4).run(_batch_check_gathers, dict(dp=4)) == [[1, 0]] * 4


def test_an_optimizer_built_before_parallelize_raises_and_generate_is_refused():
    """Issue 53, items 4 and 10, in one process (``dims=None`` converts the layers too):
    AdamW and SGD built before `parallelize` raise at their first step (they held the
    replaced attention and MLP weights and trained nothing); built after, they train;
    ``generate`` is refused at the call, pointing to the export."""
    model = _model("llama", 0)
    early = [torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.SGD(model.parameters())]
    hf.parallelize(model, None)
    for opt in early:
        with pytest.raises(
            ValueError,
            match=r"^\w+\.step: the optimizer holds model\.layers\.0\.self_attn\.q_proj\.weight, "
            r"a parameter that parallelize replaced .*: build the optimizer after parallelize$",
        ):
            opt.step()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    q = model.model.layers[0].self_attn.q_weight
    for opt in (
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.optim.SGD(model.parameters()),
    ):
        before = q.detach().clone()
        opt.step()
        assert not torch.equal(q, before), type(opt).__name__
    assert model(input_ids=ids, labels=ids).loss < loss
    with pytest.raises(
        ValueError,
        match=r"^generate\(\) is not supported on a parallelized model .*"
        r"fusedpar\.integrations\.hf\.save_pretrained\(model, dir\)",
    ):
        model.generate(input_ids=ids, max_new_tokens=2)


def test_cp_ring_sets_latent_attentions_ring():
    """Issue 53, item 15: the converted DeepSeek-V3's `ParallelMLA` layers carry the ring
    `parallelize` was given; another value, and "latent" on a model without latent
    attention, raise ValueError before anything changes."""
    for ring in ("latent", "expanded"):
        model = _model("deepseek_v3", 0)
        hf.parallelize(model, None, cp_ring=ring)
        rings = [m.cp_ring for m in model.modules() if isinstance(m, fp.nn.ParallelMLA)]
        assert rings == [ring] * model.config.num_hidden_layers
    with pytest.raises(
        ValueError,
        match=r"cp_ring must be one of \('auto', 'latent', 'expanded'\), got 'compressed'",
    ):
        hf.parallelize(_model("deepseek_v3", 0), None, cp_ring="compressed")
    llama = _model("llama", 0)
    with pytest.raises(
        ValueError,
        match=r"cp_ring='latent' is latent attention's ring, and llama has none",
    ):
        hf.parallelize(llama, None, cp_ring="latent")
    assert not any(isinstance(m, fp.nn.ParallelAttention) for m in llama.modules())
    hf.parallelize(llama, None, cp_ring="expanded")  # what a ring of its heads moves
