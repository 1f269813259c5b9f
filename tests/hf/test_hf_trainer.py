"""`fusedpar.integrations.hf.Trainer`: Hugging Face's Trainer on a `parallelize`d tiny
Llama (2 layers, fp32, 4 gloo ranks under torchrun's environment) takes three steps
exactly as the manual loop does (AdamW, constant learning rate, gradients clipped to a
norm they exceed): the same loss and gradient norm at each step, the same weights after
(bit for bit: the same ops in the same order; the Trainer's scaling of the loss by dp and
its token count divided by the ranks of a batch are powers of two here). At TP2 x CP2
every rank takes the same batches in order; at DP2 x TP2 (random order, labels masked
unevenly, activation checkpointing) each dp rank takes its own half of the seeded order
and both tp ranks the same, the loss normalized by both dp ranks' tokens; and FSDP2 over
dp with gradient accumulation. What cannot work is refused when the Trainer is built."""

import contextlib
import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp

transformers = pytest.importorskip(
    "transformers", reason="the [test] extra installs transformers; absent on purpose here"
)
accelerate = pytest.importorskip("accelerate", reason="the Trainer needs it (the [test] extra)")
hf = pytest.importorskip("fusedpar.integrations.hf")
hf_trainer = pytest.importorskip("fusedpar.integrations.hf_trainer")

SEQ, BATCH, VOCAB, STEPS, LR, CLIP = 16, 2, 64, 3, 1e-2, 0.5


def _model(seed: int = 0):
    """A tiny random Llama, every parameter re-drawn (Hugging Face's init of norms to 1
    would hide a dropped one)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def _rows(count: int, masked: bool) -> list[dict]:
    """`count` samples of SEQ random tokens; `masked`: a random number of each row's
    labels -100 (so the dp ranks' batches hold different token counts)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    labels = ids.clone()
    if masked:
        for row, cut in enumerate(torch.randint(1, SEQ // 2, (count,), generator=g).tolist()):
            labels[row, :cut] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


@contextlib.contextmanager
def _torchrun_environment():
    """The variables torchrun sets, from which accelerate decides the Trainer runs on
    several CPU processes (MULTI_CPU; the process group exists already); the threads
    stay the World's (accelerate sets them where OMP_NUM_THREADS is unset)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = dict(os.environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS=str(torch.get_num_threads()),
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def _arguments(out: str, **changes):
    options = dict(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=CLIP,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        seed=3,
        include_num_input_tokens_seen="all",
    )
    return transformers.TrainingArguments(**{**options, **changes})


def _train(model, data, out, **changes):
    """Three Trainer steps; returns (losses, grad norms, each forward's input_ids,
    tokens seen) as the Trainer logged them, and the microbatches whose FSDP2
    reduce-scatter the Trainer deferred."""
    seen, deferred = [], []
    model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["input_ids"].clone()), with_kwargs=True, prepend=True
    )
    trainer = hf.Trainer(model=model, args=_arguments(out, **changes), train_dataset=data)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    defer = trainer._defer_fsdp_gradient_reduction  # counted where the Trainer enters it
    trainer._defer_fsdp_gradient_reduction = lambda: deferred.append(1) or defer()
    gc.freeze()  # the Trainer's gc.collect() walks the rank's whole heap: seconds
    try:
        trainer.train()
    finally:
        gc.unfreeze()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return (
        [e["loss"] for e in logs],
        [e["grad_norm"] for e in logs],
        seen,
        trainer.state.num_input_tokens_seen,
        len(deferred),
    )


def _manual(model, batches, dp_group, accumulate: int = 1):
    """The manual loop on `batches` (each a dict of input_ids, labels); the loss as the
    Trainer computes it under data parallelism: each rank's summed cross entropy over
    the mean token count of the dp ranks' batches (HF's num_items_in_batch), reported as
    the mean over every process. Returns (losses, grad norms)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    dp = fp.comm.group_size(dp_group)
    losses, norms = [], []
    for step in range(STEPS):
        micro = batches[step * accumulate : (step + 1) * accumulate]
        tokens = sum((b["labels"][:, 1:] != -100).sum() for b in micro).float()
        total = 0.0
        if dp > 1:
            dist.all_reduce(tokens, group=fp.comm.resolve_group(dp_group))
        for b in micro:
            loss = model(**b, num_items_in_batch=tokens / dp).loss
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        reported = [torch.zeros(()) for _ in range(dist.get_world_size())]  # as the Trainer
        dist.all_gather(reported, total)  # logs it: the mean over every process
        losses.append(torch.stack(reported).mean().item())
        norms.append(norm.full_tensor().item())
    return losses, norms


def _same_weights(model, other) -> bool:
    return all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )


def _refusal(model, out, data) -> str:
    """What building the Trainer on `model` raised (the same on every rank: no collective)."""
    try:
        hf.Trainer(model=model, args=_arguments(out), train_dataset=data)
    except ValueError as e:
        return str(e)
    return "built"


def _run_tp_cp():
    """TP2 x CP2: the whole batches in order on every rank. Refused: the Trainer where
    accelerate sees one process (no torchrun environment), a model converted for one
    process, a pipeline, a parameter added after parallelize."""
    dims = fp.ParallelDims(cp=2, tp=2)
    data = _rows(BATCH * STEPS, masked=False)
    reference = _model()
    mesh = hf.parallelize(reference, dims)
    batches = [
        transformers.default_data_collator(data[i : i + BATCH]) for i in range(0, len(data), BATCH)
    ]
    losses, norms = _manual(reference, batches, dims.groups(mesh)["dp"])
    model = _model()
    hf.parallelize(model, dims, mesh=mesh)
    alone, staged = _model(), _model()
    hf.parallelize(alone, None)  # one process's model under 4
    hf.parallelize(staged, fp.ParallelDims(pp=2, tp=2))
    with tempfile.TemporaryDirectory() as out:
        refused = [_refusal(model, out, data), _refusal(alone, out, data)]
        refused.append(_refusal(staged, out, data))
        model.extra = torch.nn.Parameter(torch.ones(2))  # not on the mesh
        refused.append(_refusal(model, out, data))
        del model.extra
        with _torchrun_environment():
            got, got_norms, seen, tokens, deferred = _train(
                model, data, out, train_sampling_strategy="sequential"
            )
    assert got == losses and got_norms == norms, (got, losses, got_norms, norms)
    assert _same_weights(model, reference)
    assert all(torch.equal(s, b["input_ids"]) for s, b in zip(seen, batches, strict=True))
    assert tokens == STEPS * BATCH * SEQ  # counted once per batch, not per rank
    assert deferred == 0  # (no FSDP2)
    # no torchrun variables: accelerate sees one process
    assert "sees 1 process(es)" in refused[0] and "torch.distributed has 4" in refused[0]
    assert "dims=None under 4 processes" in refused[1]
    assert "a pipeline (2 stages)" in refused[2]
    assert "parameters that are not on the mesh (extra)" in refused[3]
    return tuple(got)


def _run_dp_tp():
    """DP2 x TP2: each dp rank its half of the seeded random order, both tp ranks the
    same; activation checkpointing; then FSDP2 over dp with two microbatches a step."""
    dims = fp.ParallelDims(dp=2, tp=2)
    data = _rows(BATCH * STEPS * 2, masked=True)
    model = _model()
    mesh = hf.parallelize(model, dims)
    dp_group = dims.groups(mesh)["dp"]
    with tempfile.TemporaryDirectory() as out, _torchrun_environment():
        got, got_norms, seen, tokens, _ = _train(model, data, out, activation_checkpointing=True)
    rows = {tuple(ids.tolist()): i for i, ids in enumerate(d["input_ids"] for d in data)}
    mine = [rows[tuple(r.tolist())] for ids in seen for r in ids]  # sample indices, in order
    everyone = [None] * 4
    dist.all_gather_object(everyone, mine)
    # ranks (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1): tp ranks alike, dp ranks disjoint
    assert everyone[0] == everyone[1] and everyone[2] == everyone[3]
    assert sorted(everyone[0] + everyone[2]) == list(range(len(data)))
    batches = [
        transformers.default_data_collator([data[i] for i in mine[k : k + BATCH]])
        for k in range(0, len(mine), BATCH)
    ]
    reference = _model()
    hf.parallelize(reference, dims, mesh=mesh)
    losses, norms = _manual(reference, batches, dp_group)
    assert got == losses and got_norms == norms, (got, losses, got_norms, norms)
    assert _same_weights(model, reference)
    assert tokens == STEPS * BATCH * SEQ * 2

    # FSDP2 over dp, blocks then the model, two microbatches a step: the Trainer defers
    # the first microbatch's reduce-scatter (the model is an FSDP module)
    models = []
    for _ in range(2):
        models.append(_model())
        hf.parallelize(models[-1], dims, mesh=mesh)
        for layer in models[-1].model.layers:
            dims.fully_shard(layer, mesh)
        dims.fully_shard(models[-1], mesh)
    data = _rows(BATCH * STEPS * 4, masked=True)
    with tempfile.TemporaryDirectory() as out, _torchrun_environment():
        fsdp, _, seen, _, deferred = _train(
            models[0],
            data,
            out,
            gradient_accumulation_steps=2,
            train_sampling_strategy="sequential",
        )
    assert deferred == STEPS  # the first microbatch of each step
    rank = fp.comm.group_rank(dp_group)
    order = [data[(k * 2 + rank) * BATCH : (k * 2 + rank + 1) * BATCH] for k in range(STEPS * 2)]
    batches = [transformers.default_data_collator(rows) for rows in order]
    assert all(torch.equal(s, b["input_ids"]) for s, b in zip(seen, batches, strict=True))
    losses, _ = _manual(models[1], batches, dp_group, accumulate=2)
    # the manual loop reduce-scatters after each microbatch, the Trainer after the second:
    # the same sums in another order, fp32 rounding (7e-7 seen in the weights)
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(losses), rtol=1e-6, atol=0)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=1e-5)
    return tuple(got)


def _run_layouts():
    return _run_tp_cp(), _run_dp_tp()


def test_the_trainer_takes_the_manual_loops_steps(world):
    results = world(4).run(_run_layouts)
    assert len(set(results)) == 1  # and the losses are the same on every rank


REFUSED = {  # TrainingArguments' (or the Trainer's) options: what the refusal names
    "fp16": (dict(fp16=True), "fp16"),
    "label smoothing": (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    "saving": (dict(save_strategy="steps"), "save_strategy='steps'"),
    "evaluation": (dict(eval_strategy="steps", eval_dataset=[]), "eval_strategy='steps'"),
    "length groups": (dict(train_sampling_strategy="group_by_length"), "group_by_length"),
    "tokens per rank": (dict(average_tokens_across_devices=False), "average_tokens_across"),
    "metrics": (dict(compute_metrics=lambda p: {}), "compute_metrics"),
    "a loss of the logits": (dict(compute_loss_func=lambda *a, **k: 0), "compute_loss_func"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_work_is_refused_when_the_trainer_is_built(case, tmp_path):
    options, match = REFUSED[case]
    options = dict(options)
    model = _model()
    hf.parallelize(model, None)
    given = {
        k: options.pop(k)
        for k in ("compute_metrics", "compute_loss_func", "eval_dataset")
        if k in options
    }
    with pytest.raises(ValueError, match=match):
        hf.Trainer(
            model=model,
            args=_arguments(str(tmp_path), **options),
            **given,
            train_dataset=_rows(BATCH, masked=False),
        )


def _without_a_call(name: str):
    """The Trainer's source with its calls of `name` renamed (as a release might)."""
    read = hf_trainer._trainer_source  # (the real one, read when the test runs)
    return lambda: read().replace(f"self.{name}", f"self.{name}_renamed")


def _owner(cls: type, name: str) -> type:
    """The class of `cls`'s bases that defines `name` (delattr takes it there)."""
    return next(base for base in cls.__mro__ if name in vars(base))


FLAG = hf_trainer.LOADED_BY_TRANSFORMERS
GONE = {  # what a later transformers might change: (monkeypatch's call, its arguments)
    "a method gone": ("delattr", (transformers.Trainer, "_clip_grad_norm")),
    "a call gone": ("setattr", (hf_trainer, "_trainer_source", _without_a_call("get_tp_size"))),
    "the model's flag gone": (
        "delattr",
        (_owner(transformers.PreTrainedModel, FLAG), FLAG),
    ),
}
GONE_NAMED = {
    "a method gone": r"Trainer\._clip_grad_norm \(absent\)",
    "a call gone": r"Trainer\.get_tp_size \(not called: no 'self\.get_tp_size\(\)'\)",
    "the model's flag gone": r"PreTrainedModel\.is_distributed_loading_by_transformers \(absent",
}


@pytest.mark.parametrize("case", list(GONE))
def test_a_transformers_without_the_internals_it_overrides_is_refused(monkeypatch, tmp_path, case):
    """An internal of transformers.Trainer that this module overrides, gone or no longer
    called (a later transformers), or the model's flag for the Trainer's own-placement
    path: the Trainer refuses to be built, naming it and the version tested."""
    model = _model()
    hf.parallelize(model, None)
    call, arguments = GONE[case]
    getattr(monkeypatch, call)(*arguments)
    with pytest.raises(RuntimeError, match=GONE_NAMED[case]) as raised:
        hf.Trainer(model=model, args=_arguments(str(tmp_path)), train_dataset=[])
    assert "tested with transformers 5.23" in str(raised.value)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from _rows(BATCH, masked=False)


def test_models_data_and_calls_the_trainer_cannot_take(tmp_path):
    """An unconverted model, batch="local", an iterable dataset; evaluation, prediction
    and resuming from the Trainer's checkpoints."""
    args, data = _arguments(str(tmp_path)), _rows(BATCH, masked=False)
    with pytest.raises(TypeError, match="converted by fusedpar.integrations.hf.parallelize"):
        hf.Trainer(model=_model(), args=args, train_dataset=data)
    local = _model()
    hf.parallelize(local, None, batch="local")
    with pytest.raises(ValueError, match="batch='full'"):
        hf.Trainer(model=local, args=args, train_dataset=data)
    model = _model()
    hf.parallelize(model, None)
    with pytest.raises(ValueError, match="an iterable train_dataset"):
        hf.Trainer(model=model, args=args, train_dataset=_Stream())
    trainer = hf.Trainer(model=model, args=args, train_dataset=data)
    for call, match in (
        (trainer.evaluate, "evaluate: the Trainer's evaluation gathers"),
        (trainer.predict, "predict"),
        (lambda: trainer.train(str(tmp_path)), "resume_from_checkpoint"),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_save_model_calls_the_models_save_pretrained_on_every_rank(tmp_path):
    """``trainer.save_model(dir)``: the model's own ``save_pretrained(dir)`` with no state
    dict (a converted model's gathers its weights on every rank), and the arguments."""
    model = _model()
    hf.parallelize(model, None)
    calls = []
    model.save_pretrained = lambda *args, **kwargs: calls.append((args, kwargs))
    trainer = hf.Trainer(model=model, args=_arguments(str(tmp_path)), train_dataset=[])
    trainer.save_model(str(tmp_path / "out"))
    assert calls == [((str(tmp_path / "out"),), {})]
    assert (tmp_path / "out" / "training_args.bin").exists()
