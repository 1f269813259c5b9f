"""Which layout? Memory, traffic and step time of dp x fsdp x tp x cp x ep x pp layouts,
from the same accounting the tests hold equal to what the code allocates and sends.

    from fusedpar import plan
    est = plan.estimate("llama3-70b", fp.ParallelDims(dp=8, tp=8), seq_len=8192)
    ranked = plan.search("llama3-70b", gpus=64, gpus_per_node=8, seq_len=8192,
                         global_batch_tokens=4 * 2**20)

`python -m fusedpar.plan --help` for the command line. See docs/plan.md.
"""

import torch

from fusedpar.plan.accounting import POLICIES, Local, stage_saved
from fusedpar.plan.devices import DEVICES, Device
from fusedpar.plan.estimate import Estimate, estimate
from fusedpar.plan.memory import latent_ring
from fusedpar.plan.model import PRESETS, ModelSpec, from_hf_config, model_spec
from fusedpar.plan.search import SearchResult, search

__all__ = [
    "DEVICES",
    "Local",
    "POLICIES",
    "PRESETS",
    "Device",
    "Estimate",
    "ModelSpec",
    "SearchResult",
    "activation_bytes",
    "estimate",
    "from_hf_config",
    "model_spec",
    "search",
]


def activation_bytes(
    model,
    dims,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dtype=torch.bfloat16,
    checkpointing: str = "none",
    stage=None,
    cp_ring: str = "auto",
) -> int:
    """Bytes one microbatch leaves saved for the backward on a rank of `dims` (the whole
    model without pipeline parallelism; `stage`: (first layer, layers, first, last)).
    `cp_ring`: MLA's ring, as `estimate` takes it ("auto": a GPU's choice)."""
    spec = model_spec(model)
    e = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else dtype.itemsize
    z = Local(
        seq_len,
        micro_batch,
        dims.cp,
        dims.ulysses,
        dims.tp,
        dims.ep_size,
        e,
        latent_ring=latent_ring(spec, dims, cp_ring),
    )
    if stage is None:
        stage = (0, spec.n_layers, True, True)
    start, count, first, last = stage
    return stage_saved(spec, range(start, start + count), z, checkpointing, first=first, last=last)
