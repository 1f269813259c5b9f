"""`fusedpar.plan` against Hugging Face models converted by `fusedpar.integrations.hf`:
what the planner says a rank holds, saves and sends for ``plan.from_hf_config(config)``
equals, exactly, what the converted model allocates, saves and sends. Tiny random
models, 2 layers each (test_hf's configs): "llama" (dense GQA, q/k/v/o and MLP biases;
tied embeddings too), "qwen3_moe" (per-head q/k norms, MoE) and "deepseek_v3" (latent
attention with q's latent, a dense first layer, then MoE with a shared expert and the
sigmoid router); at one process also qwen3, qwen2_moe, glm4_moe and qwen3_moe with a
dense first layer (`mlp_only_layers`).

- saved activations of one forward under each checkpointing policy (none; selective,
  ``fp.checkpoint_policy()``; full), the decoder layers checkpointed by Hugging Face's
  own ``activation_checkpointing_enable``: the distinct storages ``SavedActivations``
  counts, parameters left out, against ``plan.activation_bytes`` (Hugging Face's own
  RMSNorm, embedding, LM head and `parallelize`'s loss included); fp32 and fp16 at one
  process, fp32 on 4 gloo ranks at DP2 x TP2, CP2 x TP2, CP2 x Ulysses 2 (llama,
  qwen3_moe with EP over ulysses), CP2 x TP2 with EP over tp (qwen3_moe, deepseek_v3:
  the CPU's ring moves MLA's expanded K/V). A MoE rank's rows depend on the routing: the
  planner takes it balanced, so an EP group's sum is what is held equal;
- parameters, gradients and AdamW's state after a step (AdamW's ``step`` one fp32
  scalar a parameter), the collectives of a training step with the bytes of their
  tensors (`Collectives`), and the most saved bytes a rank holds at once in it
  (`test_plan.check_peaks`), per rank, at DP2 x TP2 (FSDP2, each decoder layer a unit),
  CP2 x TP2, CP2 x Ulysses 2, CP2 x TP2 with EP over tp (qwen3_moe, deepseek_v3),
  PP2 x TP2 1F1B and Interleaved1F1B (llama), and Interleaved1F1B with EP over tp
  (qwen3_moe); 4 layers where two stages a rank take one each.
"""

import dataclasses

import pytest
import torch

import fusedpar as fp
from fusedpar import plan
from fusedpar.plan.accounting import POLICIES
from fusedpar.plan.estimate import state_bytes
from fusedpar.testing import Collectives, SavedActivations

pytest.importorskip("transformers", reason="the [test] extra installs transformers")
hf = pytest.importorskip("fusedpar.integrations.hf")

from test_hf import BATCH, SEQ, VOCAB, _model  # noqa: E402
from test_plan import check_peaks  # noqa: E402

CASES = {  # name: (family, config changes over test_hf's)
    "llama": ("llama", dict(num_hidden_layers=2)),
    "llama-tied": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, mlp_only_layers=[])),
    "qwen3_moe-dense-first": ("qwen3_moe", dict(num_hidden_layers=2, mlp_only_layers=[0])),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2)),  # q/k/v biases, a gated shared expert
    # partial rotary, use_qk_norm, the sigmoid router, a dense first layer
    "glm4_moe": ("glm4_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),  # first_k_dense_replace=1: one dense, one MoE
}
LAYOUTS = [  # on 4 ranks: (case, degrees, EP over)
    ("llama", dict(dp=2, tp=2), None),
    ("llama", dict(cp=2, tp=2), None),
    ("llama", dict(cp=2, ulysses=2), None),
    ("qwen3_moe", dict(cp=2, ulysses=2), "ulysses"),
    ("qwen3_moe", dict(cp=2, tp=2), "tp"),
    ("deepseek_v3", dict(cp=2, tp=2), "tp"),
]


def _local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def _saved_in_forward(model, ids, policy: str) -> int:
    """Bytes of the distinct storages one forward keeps for its backward under `policy`
    (parameters left out), its decoder layers checkpointed as Hugging Face does it."""
    saved = SavedActivations(model.parameters())
    if policy != "none":
        options = {"use_reentrant": False}
        if policy == "selective":
            options["context_fn"] = saved.recorded(fp.checkpoint_policy())
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    try:
        with saved:
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        if policy != "none":
            model.activation_checkpointing_disable()
    del loss
    return saved.nbytes


def _measure(case: str, dtype=torch.float32, degrees=None, ep=None) -> dict:
    """On this rank (one process unless `degrees`): the bytes one forward saves under
    each policy; after a backward and one AdamW step the bytes of parameters, gradients
    and AdamW's state; the planner's beside them."""
    family, changes = CASES[case]
    dims = fp.ParallelDims(ep=ep, **(degrees or {}))
    model = _model(family, 0, **changes).to(dtype)
    spec = plan.from_hf_config(model.config)
    hf.parallelize(model, dims if degrees else None)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    got = {policy: _saved_in_forward(model, ids, policy) for policy in POLICIES}
    want = {policy: plan.activation_bytes(spec, dims, seq_len=SEQ, micro_batch=BATCH,
                                          dtype=dtype, checkpointing=policy)
            for policy in POLICIES}  # fmt: skip
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    held = [model.parameters(), (p.grad for p in model.parameters()),
            (t for s in optimizer.state.values() for t in s.values())]  # fmt: skip
    state = dict(zip(("parameters", "gradients", "optimizer"), map(_local_bytes, held),
                     strict=True))  # fmt: skip
    replicated = dataclasses.replace(dims, dp=1)  # dp replicates here: no FSDP
    planned = state_bytes(spec, replicated, range(spec.n_layers), True, True, param_dtype=dtype,
                          optimizer="adamw")  # fmt: skip
    planned.pop("numel")
    return {"saved": got, "planned": want, "state": state, "planned_state": planned}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_one_process(case, dtype):
    """Saved activations under each policy; parameters, gradients, AdamW state."""
    result = _measure(case, dtype)
    assert result["saved"] == result["planned"]
    assert result["state"] == result["planned_state"]


def _all_layouts() -> list:
    return [_measure(case, degrees=degrees, ep=ep) for case, degrees, ep in LAYOUTS]


def test_on_four_ranks(world):
    """Parameters, gradients, AdamW state per rank exactly (dp replicating); saved
    activations per rank exactly, or with EP summed over each EP group (the pairs (0, 1),
    (2, 3))."""
    per_rank = world(4).run(_all_layouts)
    for i, layout in enumerate(LAYOUTS):
        results = [rank[i] for rank in per_rank]
        for result in results:
            assert result["state"] == result["planned_state"], layout
        if layout[2] is None:
            for result in results:
                assert result["saved"] == result["planned"], layout
            continue
        for policy in POLICIES:
            for group in ((0, 1), (2, 3)):
                got = sum(results[r]["saved"][policy] for r in group)
                want = sum(results[r]["planned"][policy] for r in group)
                assert got == want, (layout, policy, group)


def _step(case: str, degrees: dict, ep=None, schedule=None) -> dict:
    """On this rank, after two training steps of a batch of 4 (the same on every rank):
    the parameters, gradients and AdamW state it holds and the collectives of the second
    step, real and planned. (The first step holds `parallelize`'s once-only checks.)"""
    from fusedpar.pipeline import stages_of
    from fusedpar.plan import traffic
    from fusedpar.plan.estimate import rank_stages, saved_peaks

    family, changes = CASES[case]
    if schedule == "Interleaved1F1B":  # two stages a rank, a layer each
        changes = {**changes, "num_hidden_layers": 4}
    dims = fp.ParallelDims(ep=ep, **degrees)
    model = _model(family, 0, **changes)
    spec = plan.from_hf_config(model.config)
    mesh = hf.parallelize(model, dims)
    microbatches = 4 if dims.pp > 1 else 1
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    pp_rank, stages, stage_ranks = 0, None, None
    if dims.pp > 1:
        pipe = fp.pipeline.split(model, dims, mesh, schedule=schedule, microbatches=microbatches)
        model = pipe.model
        pp_rank = fp.comm.group_rank(dims.groups(mesh)["pp"])
        stages = stages_of(schedule, pp_rank, dims.pp, 2)
        stage_ranks = {s: r for r in range(dims.pp) for s in stages_of(schedule, r, dims.pp, 2)}

        def forward_backward():
            pipe.step(ids, target=ids)
    else:
        if dims.dp > 1:  # each decoder layer a unit, the root another
            for layer in model.model.layers:
                dims.fully_shard(layer, mesh)
            dims.fully_shard(model, mesh)

        def forward_backward():
            model(input_ids=ids, labels=ids).loss.backward()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step is counted
        saved = SavedActivations(model.parameters())
        with Collectives() as seen, saved:
            forward_backward()
            optimizer.step()
        held = [model.parameters(), (p.grad for p in model.parameters()),
                (t for s in optimizer.state.values() for t in s.values())]  # fmt: skip
        real_state = dict(zip(("parameters", "gradients", "optimizer"), map(_local_bytes, held),
                              strict=True))  # fmt: skip
        optimizer.zero_grad()
    z = plan.Local(SEQ, 4 // microbatches, dims.cp, dims.ulysses, dims.tp, dims.ep_size, 4)
    layers, first, last, _ = rank_stages(spec, dims, schedule)[pp_rank]
    peak = None  # FSDP2 saves its gathered weights too; EP in a pipeline: `check_peaks`
    if dims.dp == 1 and not (dims.pp > 1 and dims.ep_size > 1):
        views = 2 * ids.nbytes if dims.pp > 1 else 0  # the ids and labels (int64)
        peak = (saved.peak, saved_peaks(spec, dims, z, "none", schedule, microbatches)[pp_rank],
                views)  # fmt: skip
    ledger = traffic.step(spec, dims, z, layers, first, last, microbatches, stages=stages,
                          stage_ranks=stage_ranks, cpu_checks=True)  # fmt: skip
    state = state_bytes(spec, dims, layers, first, last, param_dtype=torch.float32,
                        optimizer="adamw")  # fmt: skip
    state.pop("numel")
    return {"peak": peak,
            "real": (dict(seen.counts), dict(seen.bytes)), "planned": ledger.by_group_size(),
            "real_state": real_state, "planned_state": state}  # fmt: skip


STEP_LAYOUTS = [  # (case, degrees, EP over, schedule)
    ("llama", dict(dp=2, tp=2), None, None),
    ("llama", dict(cp=2, tp=2), None, None),
    ("llama", dict(cp=2, ulysses=2), None, None),
    ("qwen3_moe", dict(cp=2, tp=2), "tp", None),
    ("deepseek_v3", dict(cp=2, tp=2), "tp", None),
    ("llama", dict(pp=2, tp=2), None, "1F1B"),
    ("llama", dict(pp=2, tp=2), None, "Interleaved1F1B"),
    ("qwen3_moe", dict(pp=2, tp=2), "tp", "Interleaved1F1B"),
]


def _all_steps() -> list:
    return [_step(*layout) for layout in STEP_LAYOUTS]


def test_held_state_collectives_and_bytes_of_a_step(world):
    """Parameters, gradients, AdamW state, collectives: per rank, exactly; with EP the
    all-to-alls' bytes (the routed rows) summed over the ranks (the planner's routing is
    balanced). The most saved bytes a rank held at once: `check_peaks` (not under FSDP2,
    whose gathered weights are saved too, nor with EP in a pipeline)."""
    per_rank = world(4).run(_all_steps)
    for i, layout in enumerate(STEP_LAYOUTS):
        results = [rank[i] for rank in per_rank]
        for result in results:
            assert result["real_state"] == result["planned_state"], layout
            assert result["real"][0] == result["planned"][0], layout
            if layout[2] is None:
                assert result["real"][1] == result["planned"][1], layout
        if results[0]["peak"] is not None:
            check_peaks(results, layout, summed=layout[2] is not None)
        if layout[2] is not None:
            for key in results[0]["real"][1]:
                got = sum(r["real"][1].get(key, 0) for r in results)
                assert got == sum(r["planned"][1].get(key, 0) for r in results), (layout, key)
