"""`fusedpar.plan` against Hugging Face models converted by `fusedpar.integrations.hf`:
what the planner says a rank holds, saves and sends for ``plan.from_hf_config(config)``
equals, exactly, what the converted model allocates, saves and sends. Tiny random
models, 2 layers each (support.hf_models' configs): "llama" (dense GQA, q/k/v/o and MLP biases;
tied embeddings too), "qwen3_moe" (per-head q/k norms, MoE) and "deepseek_v3" (latent
attention with q's latent, a dense first layer, then MoE with a shared expert and the
sigmoid router); at one process also mistral, qwen2, qwen3, phi3, mixtral, qwen2_moe,
glm4_moe and qwen3_moe with a dense first layer (`mlp_only_layers`).

- at one process, fp32 and fp16: saved activations of one forward under each
  checkpointing policy (none; selective, ``fp.checkpoint_policy()``; full), the decoder
  layers checkpointed by Hugging Face's own ``activation_checkpointing_enable``: the
  distinct storages ``SavedActivations`` counts, parameters left out, against
  ``plan.activation_bytes`` (Hugging Face's own RMSNorm, embedding, LM head and
  `parallelize`'s loss included); parameters, gradients and AdamW's state after a step
  (AdamW's ``step`` one fp32 scalar a parameter);
- on 4 gloo ranks, fp32, per rank: the same state after a training step (a pipeline's
  second), the collectives of that step with the bytes of their tensors (`Collectives`),
  the most saved bytes the rank held at once in it (`test_plan.check_peaks`) and, without
  a pipeline, the saved activations of one forward under each policy; each of llama,
  qwen3_moe and deepseek_v3 at DP2 x TP2 (FSDP2, each decoder layer a unit), CP2 x TP2,
  CP2 x Ulysses 2, PP2 x TP2 1F1B and Interleaved1F1B (4 layers, a stage each), the MoE
  families with EP over tp (over ulysses at CP2 x Ulysses 2); pipelines' steps under
  full or selective checkpointing as LAYOUTS says; deepseek_v3's ring moving MLA's
  expanded K/V (the CPU's choice) and, at CP2 x TP2 again, the latent, as "auto" does on
  a GPU. A MoE rank's rows depend on the routing: the planner takes it balanced, so an
  EP group's sum is what is held equal.
"""

import pytest
import torch
from torch.utils.checkpoint import noop_context_fn

import fusedpar as fp
from fusedpar import plan
from fusedpar.plan.accounting import POLICIES
from fusedpar.plan.memory import PipelineRank, state_bytes
from fusedpar.testing import Collectives, SavedActivations

pytest.importorskip("transformers", reason="the [test] extra installs transformers")
hf = pytest.importorskip("fusedpar.integrations.hf")

from tests.plan.helpers import check_peaks, held_state  # noqa: E402
from tests.support.hf_models import BATCH, SEQ, VOCAB  # noqa: E402
from tests.support.hf_models import tiny_model as _model  # noqa: E402

CASES = {  # name: (family, config changes over hf_models')
    "llama": ("llama", dict(num_hidden_layers=2)),
    "llama-tied": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2)),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "phi3": ("phi3", {}),  # fused qkv and gate_up
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, mlp_only_layers=[])),
    "qwen3_moe-dense-first": ("qwen3_moe", dict(num_hidden_layers=2, mlp_only_layers=[0])),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2)),  # q/k/v biases, a gated shared expert
    # partial rotary, use_qk_norm, the sigmoid router, a dense first layer
    "glm4_moe": ("glm4_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),  # first_k_dense_replace=1: one dense, one MoE
}


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


def _measure(case: str, dtype) -> dict:
    """At one process: the bytes one forward saves under each policy; after a backward
    and one AdamW step the bytes of parameters, gradients and AdamW's state; the
    planner's beside them."""
    family, changes = CASES[case]
    dims = fp.ParallelDims()
    model = _model(family, 0, **changes).to(dtype)
    spec = plan.from_hf_config(model.config)
    hf.parallelize(model, None)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    got = {policy: _saved_in_forward(model, ids, policy) for policy in POLICIES}
    want = {
        policy: plan.activation_bytes(
            spec, dims, seq_len=SEQ, micro_batch=BATCH, dtype=dtype, checkpointing=policy
        )
        for policy in POLICIES
    }
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    optimizer.step()
    state = held_state(model, optimizer)
    whole = PipelineRank(tuple(range(spec.n_layers)), first=True, last=True)
    planned = state_bytes(spec, dims, whole, param_dtype=dtype, optimizer="adamw")
    planned.pop("numel")
    return {"saved": got, "planned": want, "state": state, "planned_state": planned}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_one_process(case, dtype):
    """Saved activations under each policy; parameters, gradients, AdamW state."""
    result = _measure(case, dtype)
    assert result["saved"] == result["planned"]
    assert result["state"] == result["planned_state"]


def _step(
    case: str, degrees: dict, ep=None, schedule=None, policy="none", cp_ring="expanded"
) -> dict:
    """On this rank, a batch of 4 (the same on every rank): without a pipeline the bytes
    one forward saves under each policy, then a training step (in a pipeline two), the
    decoder layers checkpointed under `policy`, MLA's ring `cp_ring` (a CPU's choice:
    "expanded"). After them: the parameters, gradients and AdamW state this rank holds,
    the collectives of the last step and the most saved bytes it held at once in it;
    real and planned. (The first call holds `parallelize`'s once-only checks, a
    pipeline's first step its shape inference.)"""
    from fusedpar.plan import traffic
    from fusedpar.plan.memory import latent_ring, rank_stages, saved_peaks

    family, changes = CASES[case]
    if schedule == "Interleaved1F1B":  # two stages a rank, a layer each
        changes = {**changes, "num_hidden_layers": 4}
    dims = fp.ParallelDims(ep=ep, **degrees)
    model = _model(family, 0, **changes)
    spec = plan.from_hf_config(model.config)
    mesh = hf.parallelize(model, dims, cp_ring=cp_ring)
    microbatches = 4 if dims.pp > 1 else 1
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    forward_saved = None
    if dims.pp == 1:  # before FSDP2 wraps the layers
        forward_saved = (
            {p: _saved_in_forward(model, ids, p) for p in POLICIES},
            {
                p: plan.activation_bytes(
                    spec,
                    dims,
                    seq_len=SEQ,
                    micro_batch=4,
                    dtype=torch.float32,
                    checkpointing=p,
                    cp_ring=cp_ring,
                )
                for p in POLICIES
            },
        )
    if policy != "none":

        def context_fn():  # selective checkpointing's cache followed by the step's `saved`
            if policy == "selective":
                return saved.recorded(fp.checkpoint_policy())()
            return noop_context_fn()

        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn}
        )
    pp_rank = 0
    if dims.pp > 1:
        pipe = fp.pipeline.split(model, dims, mesh, schedule=schedule, microbatches=microbatches)
        model = pipe.model
        pp_rank = fp.comm.group_rank(dims.groups(mesh)["pp"])

        def forward_backward():
            pipe.step(ids, target=ids)
    else:
        if dims.dp > 1:  # each decoder layer a unit, the root another
            for layer in model.model.layers:
                dims.fully_shard(layer, mesh)
            dims.fully_shard(model, mesh)

        def forward_backward():
            model(input_ids=ids, labels=ids).loss.backward()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2 if dims.pp > 1 else 1):  # the last step is counted
        saved = SavedActivations(model.parameters())
        with Collectives() as seen, saved:
            forward_backward()
            optimizer.step()
        real_state = held_state(model, optimizer)
        optimizer.zero_grad()
    z = plan.Local(
        SEQ,
        4 // microbatches,
        dims.cp,
        dims.ulysses,
        dims.tp,
        dims.ep_size,
        4,
        latent_ring=latent_ring(spec, dims, cp_ring),
    )
    rank = rank_stages(spec, dims, schedule)[pp_rank]
    peak = None  # FSDP2 saves its gathered weights too; EP in a pipeline: `check_peaks`
    if dims.dp == 1 and not (dims.pp > 1 and dims.ep_size > 1):
        views = 2 * ids.nbytes if dims.pp > 1 else 0  # the ids and labels (int64)
        peak = (
            saved.peak,
            saved_peaks(spec, dims, z, policy, schedule, microbatches)[pp_rank],
            views,
        )
    ledger = traffic.step(spec, dims, z, rank, microbatches, policy=policy, cpu_checks=True)
    state = state_bytes(spec, dims, rank, param_dtype=torch.float32, optimizer="adamw")
    state.pop("numel")
    return {
        "peak": peak,
        "saved": forward_saved,
        "real": (dict(seen.counts), dict(seen.bytes)),
        "planned": ledger.by_group_size(),
        "real_state": real_state,
        "planned_state": state,
    }


LAYOUTS = [  # on 4 ranks: (case, degrees, EP over, schedule, the step's checkpointing,
    # MLA's ring); each family at each layout
    ("llama", dict(dp=2, tp=2), None, None),
    ("llama", dict(cp=2, tp=2), None, None),
    ("llama", dict(cp=2, ulysses=2), None, None),
    ("llama", dict(pp=2, tp=2), None, "1F1B"),
    ("llama", dict(pp=2, tp=2), None, "Interleaved1F1B", "full"),
    ("qwen3_moe", dict(dp=2, tp=2), "tp", None),
    ("qwen3_moe", dict(cp=2, tp=2), "tp", None),
    ("qwen3_moe", dict(cp=2, ulysses=2), "ulysses", None),
    ("qwen3_moe", dict(pp=2, tp=2), "tp", "1F1B", "full"),
    ("qwen3_moe", dict(pp=2, tp=2), "tp", "Interleaved1F1B", "selective"),
    ("deepseek_v3", dict(dp=2, tp=2), "tp", None),
    ("deepseek_v3", dict(cp=2, tp=2), "tp", None),
    ("deepseek_v3", dict(cp=2, tp=2), "tp", None, "selective", "latent"),
    ("deepseek_v3", dict(cp=2, ulysses=2), "ulysses", None),
    ("deepseek_v3", dict(pp=2, tp=2), "tp", "1F1B", "selective"),
    ("deepseek_v3", dict(pp=2, tp=2), "tp", "Interleaved1F1B"),
]


def _all_layouts() -> list:
    return [_step(*layout) for layout in LAYOUTS]


def test_on_four_ranks(world):
    """Per rank, exactly: parameters, gradients, AdamW state, collectives; without a
    pipeline the saved activations under each policy; the most saved bytes held at once
    (`check_peaks`: not under FSDP2, whose gathered weights are saved too, nor with EP in
    a pipeline). With EP (the planner's routing is balanced) the all-to-alls' bytes summed
    over the ranks, the saved activations over each EP group (the pairs (0, 1), (2, 3))."""
    per_rank = world(4).run(_all_layouts)
    for i, layout in enumerate(LAYOUTS):
        results = [rank[i] for rank in per_rank]
        ep = layout[2]
        for result in results:
            assert result["real_state"] == result["planned_state"], layout
            assert result["real"][0] == result["planned"][0], layout
            if ep is None:
                assert result["real"][1] == result["planned"][1], layout
        if results[0]["peak"] is not None:
            check_peaks(results, layout, summed=ep is not None)
        if ep is not None:
            for key in results[0]["real"][1]:
                got = sum(r["real"][1].get(key, 0) for r in results)
                assert got == sum(r["planned"][1].get(key, 0) for r in results), (layout, key)
        if results[0]["saved"] is None:
            continue
        for group in ((0, 1), (2, 3)) if ep else ((r,) for r in range(4)):
            for policy in POLICIES:
                got = sum(results[r]["saved"][0][policy] for r in group)
                want = sum(results[r]["saved"][1][policy] for r in group)
                assert got == want, (layout, policy, group)
