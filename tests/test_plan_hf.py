"""`fusedpar.plan` against Hugging Face models converted by `fusedpar.integrations.hf`:
what the planner says a rank holds and saves for ``plan.from_hf_config(config)`` equals,
exactly, what the converted model allocates and saves. Tiny random models, 2 layers
each (test_hf's configs): "llama" (dense GQA, q/k/v/o and MLP biases; tied embeddings
too), "qwen3_moe" (per-head q/k norms, MoE) and "deepseek_v3" (latent attention with
q's latent, a dense first layer, then MoE with a shared expert and the sigmoid router),
at one process and on 4 gloo ranks: llama at DP2 x TP2 (dp replicates: no FSDP) and
CP2 x TP2, qwen3_moe and deepseek_v3 at CP2 x TP2 with EP over tp (the CPU's ring moves
MLA's expanded K/V); at one process also qwen3, qwen2_moe and glm4_moe.

- parameters, gradients after a backward and AdamW's state after a step: the bytes of
  each rank's real tensors (local shards; AdamW's ``step`` one fp32 scalar a parameter)
  against ``estimate.state_bytes``;
- saved activations of one forward with no checkpointing: the distinct storages
  ``saved_tensors_hooks`` packs, parameters left out, against ``plan.activation_bytes``
  (Hugging Face's own RMSNorm, embedding, LM head and `parallelize`'s loss included),
  in fp32 and fp16 at one process, fp32 on the ranks. A MoE rank's rows depend on the
  routing: the planner takes it balanced, so an EP group's sum is what is held equal.
"""

import dataclasses

import pytest
import torch

import fusedpar as fp
from fusedpar import plan
from fusedpar.plan.estimate import state_bytes

pytest.importorskip("transformers", reason="the [test] extra installs transformers")
hf = pytest.importorskip("fusedpar.integrations.hf")

from test_hf import BATCH, SEQ, VOCAB, _model  # noqa: E402

CASES = {  # name: (family, config changes over test_hf's)
    "llama": ("llama", dict(num_hidden_layers=2)),
    "llama-tied": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, mlp_only_layers=[])),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2)),  # q/k/v biases, a gated shared expert
    # partial rotary, use_qk_norm, the sigmoid router, a dense first layer
    "glm4_moe": ("glm4_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),  # first_k_dense_replace=1: one dense, one MoE
}
LAYOUTS = [  # on 4 ranks: (case, degrees, EP over)
    ("llama", dict(dp=2, tp=2), None),
    ("llama", dict(cp=2, tp=2), None),
    ("qwen3_moe", dict(cp=2, tp=2), "tp"),
    ("deepseek_v3", dict(cp=2, tp=2), "tp"),
]


def _saved_in_forward(model, ids) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages one forward keeps for its backward (parameters left
    out), and its loss."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t):
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return sum(storages.values()), loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_bytes(tensors) -> int:
    return sum(_local(t).nbytes for t in tensors)


def _measure(case: str, dtype=torch.float32, degrees=None, ep=None) -> dict:
    """On this rank (one process unless `degrees`): saved bytes of one forward, then
    after its backward and one AdamW step the bytes of parameters, gradients and AdamW's
    state; beside them the planner's."""
    family, changes = CASES[case]
    dims = fp.ParallelDims(ep=ep, **(degrees or {}))
    model = _model(family, 0, **changes).to(dtype)
    spec = plan.from_hf_config(model.config)
    hf.parallelize(model, dims if degrees else None)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    saved, loss = _saved_in_forward(model, ids)
    planned = plan.activation_bytes(spec, dims, seq_len=SEQ, micro_batch=BATCH, dtype=dtype)
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    held = [model.parameters(), (p.grad for p in model.parameters()),
            (t for s in optimizer.state.values() for t in s.values())]  # fmt: skip
    real = dict(zip(("parameters", "gradients", "optimizer"), map(_local_bytes, held),
                    strict=True))  # fmt: skip
    replicated = dataclasses.replace(dims, dp=1)  # dp replicates here: no FSDP
    want = state_bytes(spec, replicated, range(spec.n_layers), True, True, param_dtype=dtype,
                       optimizer="adamw")  # fmt: skip
    want.pop("numel")
    return {"saved": saved, "planned_saved": planned, "state": real, "planned_state": want}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_one_process(case, dtype):
    """Parameters, gradients, AdamW state and saved activations, exactly."""
    result = _measure(case, dtype)
    assert result["state"] == result["planned_state"]
    assert result["saved"] == result["planned_saved"]


def _all_layouts() -> list:
    return [_measure(case, degrees=degrees, ep=ep) for case, degrees, ep in LAYOUTS]


def test_on_four_ranks(world):
    """Per rank: parameters, gradients, AdamW state exactly; saved activations exactly,
    or with EP summed over each EP group (the tp pairs (0, 1), (2, 3))."""
    per_rank = world(4).run(_all_layouts)
    for i, layout in enumerate(LAYOUTS):
        results = [rank[i] for rank in per_rank]
        for result in results:
            assert result["state"] == result["planned_state"], layout
        if layout[2] is None:
            for result in results:
                assert result["saved"] == result["planned_saved"], layout
        else:
            for group in ((0, 1), (2, 3)):
                got = sum(results[r]["saved"] for r in group)
                assert got == sum(results[r]["planned_saved"] for r in group), (layout, group)
