"""One layout's estimate: memory by part (from `accounting`, which the tests hold equal to
the code), traffic and collectives per mesh axis, and the step time.

The time model, per rank and microbatch, for each block of its stages: GEMMs at the
measured TFLOP/s of the nearest shape (bench/results/<device>/matmul.json, else a
stated fraction of peak: `devices`); attention at the measured fwd+bwd rate of the
nearest (S, D); element-wise work as saved bytes moved at HBM bandwidth; recompute per
policy; TP's collectives hidden under their GEMMs but one chunk, the ring's steps under
their blocks, Ulysses' and EP's all-to-alls exposed, FSDP2's gathers prefetched under
the previous block; the pipeline bubble simulated on torch's action lists
(`schedule.simulate`); AdamW at HBM bandwidth.

Collectives take bytes x (W - 1) / W (all-reduce twice that) over the axis's link
(NVLink when the axis's ranks share a node: mesh order (pp, dp, cp, ulysses, tp), tp
innermost) plus a latency each. See docs/plan.md for where it misses, and by how much.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from fusedpar.nn.mla import latent_moves_less
from fusedpar.parallel import ParallelDims
from fusedpar.pipeline import check_pipeline, stage_count, stages_of
from fusedpar.plan import accounting as acc
from fusedpar.plan import devices, traffic
from fusedpar.plan.model import ModelSpec, model_spec
from fusedpar.plan.schedule import in_flight, simulate

LATENCY_S = {"nvlink": 10e-6, "network": 25e-6}  # per collective
DP_SHARDING = ("zero3", "zero2", "zero1")
# FSDP2 as torchtitan runs it: MixedPrecisionPolicy(param_dtype=the compute dtype,
# reduce_dtype=float32): parameters gathered in the compute dtype, gradients reduced fp32
REDUCE_BYTES = 4
AXES = ("pp", "dp", "cp", "ulysses", "tp")


@dataclass
class Estimate:
    """One layout (see the module doc). Bytes are per rank, the largest rank's."""

    model: str
    dims: ParallelDims
    seq_len: int
    micro_batch: int
    microbatches: int
    schedule: str | None
    checkpointing: str
    dp_sharding: str = "zero3"
    memory: dict = field(default_factory=dict)
    traffic: dict = field(default_factory=dict)  # axis -> bytes sent per step
    collectives: dict = field(default_factory=dict)  # axis -> calls per step
    links: dict = field(default_factory=dict)  # axis -> "nvlink" | "network"
    times: dict = field(default_factory=dict)  # seconds per step, by term
    step_time_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    fits: bool = True
    notes: list = field(default_factory=list)
    experts: int = 0  # the model's routed experts (0: dense)
    stages_per_rank: int = 2  # a multi-stage schedule's stages on each pipeline rank

    @property
    def gpus(self) -> int:
        d = self.dims
        return d.pp * d.dp * d.cp * d.ulysses * d.tp

    def layout(self) -> str:
        d = self.dims
        parts = [f"{a}{getattr(d, a)}" for a in AXES if getattr(d, a) > 1]
        if d.ep_size > 1:
            parts.append(f"ep{d.ep_size}({'x'.join(d.ep_axes)})")
        return " ".join(parts) or "one GPU"

    def as_dict(self) -> dict:
        d = self.dims
        return {
            "model": self.model,
            "layout": self.layout(),
            "gpus": self.gpus,
            "dims": {a: getattr(d, a) for a in AXES} | {"ep": list(d.ep_axes)},
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "checkpointing": self.checkpointing,
            "dp_sharding": self.dp_sharding,
            "memory": self.memory,
            "traffic": self.traffic,
            "collectives": self.collectives,
            "links": self.links,
            "times": self.times,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "fits": self.fits,
            "notes": self.notes,
        }


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def rank_stages(spec: ModelSpec, dims: ParallelDims, schedule: str | None, per_rank: int = 2):
    """Per pipeline rank: (its layers, holds the embedding, holds the head, its stages)."""
    if dims.pp == 1:
        return [(list(range(spec.n_layers)), True, True, 1)]
    num = stage_count(schedule, dims.pp, per_rank)
    per_stage = spec.n_layers // num
    out = []
    for rank in range(dims.pp):
        stages = stages_of(schedule, rank, dims.pp, num // dims.pp)
        layers = [i for s in stages for i in range(s * per_stage, (s + 1) * per_stage)]
        out.append((layers, 0 in stages, num - 1 in stages, len(stages)))
    return out


def state_bytes(spec, dims, layers, first, last, *, param_dtype, optimizer) -> dict:
    """Parameters, gradients and optimizer state of a rank holding `layers` (FSDP2 over
    dp: each tensor's dim 0 padded and split)."""
    numel = tensors = 0
    for moe, count in Counter(spec.is_moe(i) for i in layers).items():  # alike by kind
        layer = next(i for i in layers if spec.is_moe(i) == moe)
        shapes = [s for s, _ in acc.layer_tensors(spec, layer, dims.tp, dims.ep_size)]
        numel += count * sum(acc.fsdp_numel(s, dims.dp) for s in shapes)
        tensors += count * len(shapes)
    ends = acc.model_end_tensors(spec, first=first, last=last)
    numel += sum(
        acc.fsdp_numel((n // spec.d_model, spec.d_model) if n > spec.d_model else (n,), dims.dp)
        for n, _ in ends
    )
    tensors += len(ends)
    p = _bytes(param_dtype)
    states = {"adamw": 2 * numel * p + 4 * tensors, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer must be one of {list(states)}, got {optimizer!r}")
    return {
        "parameters": numel * p,
        "gradients": numel * p,
        "optimizer": states[optimizer],
        "numel": numel,
    }


def link_of(dims: ParallelDims, axis: str, gpus_per_node: int) -> str:
    """ "nvlink" when the ranks of `axis` share a node (mesh order, tp innermost)."""
    span = 1
    for a in reversed(AXES):
        span *= getattr(dims, a)
        if a == axis:
            break
    return "nvlink" if gpus_per_node % span == 0 else "network"


class _Clock:
    """The time collectives take on a layout's links. The gradients' all-reduces are
    timed from `traffic.step`'s ledger (`group_comm`); the per-block terms follow the
    same formulas for the bytes that overlap with compute."""

    def __init__(self, dev, dims, gpn):
        self.dev, self.dims, self.gpn = dev, dims, gpn

    def comm(self, axis: str, nbytes: float, calls: int = 1, kind: str = "ring") -> float:
        """Seconds for `calls` collectives moving `nbytes` in all over `axis`."""
        size = self.dims.ep_size if axis == "ep" else getattr(self.dims, axis)
        if size <= 1 or nbytes <= 0:
            return 0.0
        link_axis = min(self.dims.ep_axes, key=AXES.index) if axis == "ep" else axis
        link = link_of(self.dims, link_axis, self.gpn)
        sent = nbytes * (size - 1) / size * (2 if kind == "all_reduce" else 1)
        if kind == "p2p":
            sent = nbytes
        bw = (self.dev.nvlink_gbps if link == "nvlink" else self.dev.network_gbps) * 1e9
        return sent / bw + calls * LATENCY_S[link]

    def group_comm(self, axes: tuple, given: float, calls: int) -> float:
        """Seconds for an all-reduce of `given` bytes in all over the group of `axes`,
        on the link of its outermost axis."""
        axes = [a for name in axes for a in (self.dims.ep_axes if name == "ep" else (name,))]
        size = math.prod(getattr(self.dims, a) for a in axes)
        if size <= 1:
            return 0.0
        link = link_of(self.dims, min(axes, key=AXES.index), self.gpn)
        bw = (self.dev.nvlink_gbps if link == "nvlink" else self.dev.network_gbps) * 1e9
        return given * 2 * (size - 1) / size / bw + calls * LATENCY_S[link]


def _gemm_s(dev, rows, out, inner) -> float:
    if rows <= 0:
        return 0.0
    tflops, _ = devices.gemm_tflops(dev, rows, out, inner)
    return 2 * rows * out * inner / (tflops * 1e12)


def block_times(spec, layer, z: acc.Local, dev, clock: _Clock, policy, knobs) -> tuple:
    """(forward s, backward s, GEMM+attention FLOPs fwd) of one block, one microbatch,
    exposed communication included (timed on `clock`)."""
    d, hd, hv, e = spec.d_model, spec.head_dim, spec.v_dim, z.e
    hq, hkv = z.heads(spec)
    moe = spec.is_moe(layer)
    # GEMMs: the attention projections over TP's gathered tokens, the MLP's
    proj_flops_in = (spec.n_heads * hd + 2 * spec.n_kv_heads * hd) // z.tp
    qkv = _gemm_s(dev, z.m, proj_flops_in, d)
    o = _gemm_s(dev, z.m, d, spec.n_heads * hv // z.tp)
    flops = 2 * z.m * d * (proj_flops_in + spec.n_heads * hv // z.tp)
    if moe:
        h, rows = spec.expert_hidden, z.n * spec.top_k
        mlp_in = _gemm_s(dev, rows, 2 * h, d) + _gemm_s(dev, z.n, spec.num_experts, d)
        mlp_out = _gemm_s(dev, rows, d, h)
        flops += 2 * rows * 3 * h * d + 2 * z.n * spec.num_experts * d
        if spec.shared_hidden:
            mlp_in += _gemm_s(dev, z.n, 2 * spec.shared_hidden, d)
            mlp_out += _gemm_s(dev, z.n, d, spec.shared_hidden)
            flops += 2 * z.n * 3 * spec.shared_hidden * d
    else:
        h, inputs = spec.d_hidden // z.tp, 1 + spec.gated  # gate and up, or fc
        mlp_in, mlp_out = _gemm_s(dev, z.m, inputs * h, d), _gemm_s(dev, z.m, d, h)
        flops += 2 * z.m * (inputs + 1) * h * d
    gemm = qkv + o + mlp_in + mlp_out
    # attention: causal, zigzag-balanced: each query sees half its document on average
    document = min(knobs.get("document_len") or z.seq, z.seq)
    att_flops = 2 * z.a * (document / 2) * hq * (hd + hv)
    att_rate, _ = devices.attention_tflops(dev, document, hd, True)
    attention = 3.5 * att_flops / (att_rate * 1e12)  # fwd + bwd, at the fwd+bwd rate
    att_f, att_b = attention / 3.5, attention * 2.5 / 3.5
    flops += att_flops
    saved = acc.block_saved(spec, layer, z, "none")
    elementwise = knobs["passes"] * saved / (dev.hbm_tbps * 1e12)
    fwd = gemm + att_f + elementwise
    bwd = 2 * gemm + att_b + 2 * elementwise
    if policy == "selective":  # what `fp.checkpoint_policy` recomputes (recompute.py)
        bwd += elementwise + (mlp_in + mlp_out if moe else 0.0)  # the experts' GEMMs
        if (z.tp > 1 and z.cp == 1) or z.ulysses > 1:  # attention no exchange keeps
            bwd += att_f
    # TP: x gathered into the projections, outputs reduce-scattered; the backward
    # re-gathers x for the weights' gradients
    if z.tp > 1:
        volume = z.m * d * e  # the gathered tensor; each GEMM's input or output
        gathers = ((qkv, True), (o, False)) + (() if moe else ((mlp_in, True), (mlp_out, False)))
        for gemm_s, gathered_input in gathers:
            # x's chunks, or the fp32 partials a reduce-scatter carries (traffic.py)
            t_f = clock.comm("tp", volume * (1 if gathered_input else 4 / e))
            t_b = clock.comm(
                "tp", volume * (1 + 4 / e if gathered_input else 1), calls=1 + gathered_input
            )
            if knobs["overlap"] == "serial":
                fwd, bwd = fwd + t_f, bwd + t_b
            else:
                fwd += max(0.0, t_f - gemm_s) + t_f / z.tp
                bwd += max(0.0, t_b - 2 * gemm_s) + t_b / z.tp
    if z.cp > 1:  # the ring: K/V blocks; backward K/V and dK/dV (fp32)
        kv = z.a * hkv * (hd + hv) * e
        if z.latent_ring and spec.mla:  # the latent and k_rope travel
            kv = z.a * (spec.kv_lora_rank + spec.rope_dim) * e
            # each step expands its block (kv_b's GEMM, over all a tokens in all); the
            # backward expands again and makes the latent's and kv_b's gradients
            expand = _gemm_s(
                dev, z.a, spec.n_heads // z.tp * (hd - spec.rope_dim + hv), spec.kv_lora_rank
            )
            fwd, bwd = fwd + expand, bwd + 3 * expand
            if policy == "selective":  # no op the policy names: recomputed
                bwd += expand + att_f
        steps = z.cp - 1
        step_f = clock.comm("cp", kv * steps, calls=steps, kind="p2p") / steps
        step_b = clock.comm("cp", (kv + kv * 4 / e) * steps, calls=2 * steps, kind="p2p") / steps
        fwd += steps * max(0.0, step_f - att_f / z.cp)
        bwd += steps * max(0.0, step_b - att_b / z.cp)
    if z.ulysses > 1:  # q, k, v out and the output back, forward and backward
        moved = z.m * (spec.n_heads * (hd + hv) + spec.n_kv_heads * (hd + hv)) // z.tp * e
        t = clock.comm("ulysses", moved, calls=4, kind="all_to_all")
        fwd, bwd = fwd + t, bwd + clock.comm("ulysses", moved, calls=4, kind="all_to_all")
    if moe and z.ep > 1:  # dispatch and return (and their counts), both passes
        rows_bytes = z.n * spec.top_k * d * e
        fwd += clock.comm("ep", 2 * rows_bytes, calls=3, kind="all_to_all")
        bwd += clock.comm("ep", 2 * rows_bytes, calls=2, kind="all_to_all")
    if policy == "full":  # the whole forward again, its collectives too
        bwd += fwd
    return fwd, bwd, flops


def estimate(
    model,
    dims: ParallelDims,
    *,
    seq_len: int,
    micro_batch: int = 1,
    microbatches: int = 1,
    schedule: str | None = None,
    dtype=torch.bfloat16,
    param_dtype=torch.float32,
    checkpointing: str = "none",
    optimizer: str = "adamw",
    device="h100",
    gpus_per_node: int = 8,
    overlap: str = "ring",
    stages_per_rank: int = 2,
    memory_margin: float = 0.9,
    dp_sharding: str = "zero3",
    elementwise_passes: float = 4.0,
    document_len: int | None = None,
    cp_ring: str = "auto",
) -> Estimate:
    """One layout's estimate (see the module doc and `Estimate`). `dims` as the layers
    take them (`fp.ParallelDims`); `micro_batch` sequences of `seq_len` tokens per
    microbatch, `microbatches` per step (the pipeline's, or gradient accumulation). A
    layout fits when its peak is at most `memory_margin` of the device's memory.

    `dp_sharding`: "zero3" (FSDP2's default: parameters gathered in each microbatch's
    forward and backward), "zero2" (``reshard_after_forward=False``: gathered once a
    microbatch, held to its backward), "zero1" (gathered once a step and held, gradients
    unsharded until one reduce-scatter a step: Megatron's distributed optimizer).
    `elementwise_passes`: how many times the element-wise ops move each saved byte in a
    forward: 4 for fused kernels (fusedpar's, Megatron's), fitted on Megatron's published
    points; eager PyTorch's norms, RoPE and activations move about 12 (torchtitan's
    points without torch.compile): docs/plan.md. `document_len`: packed documents of this
    many tokens (None: each sequence one document): attention sees its own document only
    (FLOPs, and the rate measured at that length), and RoPE's tables, which positions
    restarting per document make each microbatch's own, are not shared in flight.
    `cp_ring`: MLA's ring (`fp.nn.ParallelMLA`'s): "expanded", "latent", or "auto", which
    moves the latent where it moves fewer values than the expanded heads, as on a GPU
    (the ring alone: Ulysses moves expanded heads)."""
    if dp_sharding not in DP_SHARDING:
        raise ValueError(f"dp_sharding must be one of {DP_SHARDING}, got {dp_sharding!r}")
    spec = model_spec(model)
    dev = devices.device(device)
    if dims.pp > 1 and schedule is None:
        schedule = "1F1B"
    dims.validate(
        dims.pp * dims.dp * dims.cp * dims.ulysses * dims.tp,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        num_experts=spec.num_experts or None,
        seq_len=seq_len,
        n_layers=spec.n_layers if dims.pp > 1 else None,
        microbatches=microbatches,
        schedule=schedule or "1F1B",
    )
    if dims.pp > 1:
        check_pipeline(schedule, dims.pp, spec.n_layers, microbatches, stages_per_rank)
    if document_len is not None and not 0 < document_len <= seq_len:
        raise ValueError(f"document_len ({document_len}) must be in 1..seq_len ({seq_len})")
    if microbatches < 1 or micro_batch < 1:
        raise ValueError(
            f"micro_batch ({micro_batch}) and microbatches ({microbatches}) must be at least 1"
        )
    z = acc.Local(
        seq_len,
        micro_batch,
        dims.cp,
        dims.ulysses,
        dims.tp,
        dims.ep_size,
        _bytes(dtype),
        latent_ring=latent_ring(spec, dims, cp_ring),
    )
    est = Estimate(
        spec.name, dims, seq_len, micro_batch, microbatches, schedule, checkpointing, dp_sharding
    )
    est.experts, est.stages_per_rank = spec.num_experts, stages_per_rank
    ranks = rank_stages(spec, dims, schedule, stages_per_rank)
    peaks = saved_peaks(
        spec,
        dims,
        z,
        checkpointing,
        schedule,
        microbatches,
        stages_per_rank,
        packed=document_len is not None,
    )
    best = None
    for rank, (layers, first, last, _) in enumerate(ranks):
        mem = state_bytes(
            spec, dims, layers, first, last, param_dtype=param_dtype, optimizer=optimizer
        )
        per_mb = acc.stage_saved(spec, layers, z, checkpointing, first=first, last=last)
        mem["activations"] = per_mb
        # the pipeline's: held stage-microbatches beyond this rank's one of each stage
        mem["in_flight"] = max(0, peaks[rank] - per_mb)
        mem["buffers"] = _buffers(spec, dims, z, layers, last, param_dtype)
        if dims.dp > 1 and dp_sharding != "zero3":  # unsharded parameters (and gradients)
            whole = mem["numel"] * dims.dp
            mem["buffers"] += whole * z.e
            if dp_sharding == "zero1":
                mem["gradients"] = whole * 4
        recompute = 0
        if checkpointing != "none" and layers:
            recompute = max(acc.block_saved(spec, i, z) for i in layers)
        mem["peak"] = (
            mem["parameters"]
            + mem["gradients"]
            + mem["optimizer"]
            + per_mb
            + mem["in_flight"]
            + mem["buffers"]
            + recompute
        )
        mem.pop("numel")
        if best is None or mem["peak"] > best["peak"]:
            best = mem
    est.memory = best
    est.fits = best["peak"] <= memory_margin * dev.memory_bytes
    if not est.fits:
        short = best["peak"] - memory_margin * dev.memory_bytes
        est.notes.append(
            f"out of memory by {short / 1e9:.1f} GB "
            f"(peak {best['peak'] / 1e9:.1f} GB, {memory_margin:.0%} of "
            f"{dev.memory_gb:g} GB usable)"
        )
    knobs = {
        "overlap": overlap,
        "dp_sharding": dp_sharding,
        "passes": elementwise_passes,
        "optimizer": optimizer,
        "document_len": document_len or seq_len,
    }
    _time(est, spec, dims, z, dev, ranks, gpus_per_node, knobs, stages_per_rank, param_dtype)
    for group in est.traffic:  # the link of its outermost axis
        names = group.split(" x ")
        axes = [a for name in names for a in (dims.ep_axes if name == "ep" else (name,))]
        est.links[group] = link_of(dims, min(axes, key=AXES.index), gpus_per_node)
    return est


def _ledger(spec, dims, z, ranks, rank, m, *, schedule, per_rank, param_dtype, sharding, policy):
    """The collectives of one step on pipeline rank `rank` (`traffic.step`, the ledger
    tests/plan/test_plan.py holds equal to a real step's)."""
    layers, first, last, _ = ranks[rank]
    stages = stage_ranks = None
    if dims.pp > 1:
        per = stage_count(schedule, dims.pp, per_rank) // dims.pp
        stage_ranks = {s: r for r in range(dims.pp) for s in stages_of(schedule, r, dims.pp, per)}
        stages = [s for s, r in stage_ranks.items() if r == rank]
    ledger = traffic.step(
        spec,
        dims,
        z,
        layers,
        first,
        last,
        m,
        stages=stages,
        stage_ranks=stage_ranks,
        grad_bytes=REDUCE_BYTES,
        gather_bytes=z.e,
        dp_sharding=sharding,
        policy=policy,
    )
    return ledger


def _round(x: float) -> float:
    """`x` to 2 significant digits: pipeline bubbles are cached by these ratios."""
    return float(f"{x:.2g}")


# words an optimizer step reads and writes a parameter: AdamW p, g, m, v in and p, m, v
# out; plain SGD p, g in and p out
OPTIMIZER_WORDS = {"adamw": 7, "sgd": 3}
SIMULATED_MICROBATCHES = 32  # beyond: the steady state's, extrapolated (1F1B-like schedules)


def _simulated(schedule, pp, microbatches, per_rank) -> int:
    """The microbatch count simulated for `microbatches`: itself up to
    SIMULATED_MICROBATCHES (or 4 per stage), else the largest valid count below."""
    stages = stage_count(schedule, pp, per_rank)
    cap = max(SIMULATED_MICROBATCHES, 4 * stages)
    if microbatches <= cap or schedule in ("GPipe", "LoopedBFS"):  # they hold them all
        return microbatches
    step = pp if schedule == "Interleaved1F1B" else 1
    return cap - cap % step


@lru_cache(maxsize=4096)
def _pipeline(schedule, pp, microbatches, per_rank, backward, send) -> tuple[float, float]:
    """(step / forward, bubble) of the schedule at these ratios to the forward's time
    (`schedule.simulate`; a step's time scales with the three). Past the simulated count
    each microbatch adds its stages' forward and backward to the step."""
    simulated = _simulated(schedule, pp, microbatches, per_rank)
    per_rank_stages = stage_count(schedule, pp, per_rank) // pp
    timing = simulate(
        schedule,
        pp,
        simulated,
        forward_s=1.0,
        backward_s=backward,
        send_s=send,
        stages_per_rank=per_rank,
    )
    extra = (microbatches - simulated) * per_rank_stages * (1.0 + backward)
    step = timing.step_s + extra
    busy = max(timing.busy_s.values()) + extra
    return step, 1 - busy / step


def latent_ring(spec, dims, cp_ring: str = "auto") -> bool:
    """Whether MLA's ring moves the latent (`ParallelMLA`'s choice on a GPU)."""
    if cp_ring not in ("auto", "latent", "expanded"):
        raise ValueError(f"cp_ring must be 'auto', 'latent' or 'expanded', got {cp_ring!r}")
    if not spec.mla or dims.cp == 1 or dims.ulysses > 1 or cp_ring == "expanded":
        return False
    return cp_ring == "latent" or latent_moves_less(
        spec.n_heads // dims.tp,
        spec.head_dim - spec.rope_dim,
        spec.rope_dim,
        spec.v_dim,
        spec.kv_lora_rank,
    )


def saved_peaks(
    spec, dims, z, policy, schedule, microbatches, per_rank=2, *, packed: bool = False
) -> list[int]:
    """Per pipeline rank: the most bytes of saved activations it holds at once in a step,
    the (stage, microbatch) pairs its schedule keeps in flight each counted at its stage's
    `stage_saved`, what they share (`stage_shared`; nothing when `packed` documents give
    each microbatch its own positions) once; one microbatch's without a pipeline (each
    microbatch's backward frees what its forward saved before the next one runs)."""
    if dims.pp == 1:
        return [acc.stage_saved(spec, range(spec.n_layers), z, policy, first=True, last=True)]
    num = stage_count(schedule, dims.pp, per_rank)
    size = spec.n_layers // num
    stage_bytes = {}
    for s in range(num):
        layers = range(s * size, (s + 1) * size)
        saved = acc.stage_saved(spec, layers, z, policy, first=s == 0, last=s == num - 1)
        shared = 0 if packed else acc.stage_shared(spec, layers, z, policy)
        stage_bytes[s] = (saved - shared, shared)
    simulated = _simulated(schedule, dims.pp, microbatches, per_rank)
    peaks = in_flight(schedule, dims.pp, simulated, per_rank, stage_bytes)
    return [peaks[r] for r in range(dims.pp)]


def _buffers(spec, dims, z, layers, last, param_dtype) -> int:
    """Transient buffers (an estimate, not held exact by a test): FSDP's gathered block
    (this one and the prefetched next, in the compute dtype: `REDUCE_BYTES`'s note) and
    its unsharded fp32 gradient;
    TP's gathered input; the ring's K/V blocks in flight; the head's logits."""
    out = 0
    if dims.dp > 1 and layers:
        block = max(
            sum(math.prod(s) for s, _ in acc.layer_tensors(spec, i, dims.tp, dims.ep_size))
            for i in {spec.is_moe(i): i for i in layers}.values()
        )
        out += block * (2 * z.e + REDUCE_BYTES)  # two gathered blocks, one's gradient
    if dims.tp > 1:
        out += z.m * spec.d_model * z.e
    if dims.cp > 1:
        hq, hkv = z.heads(spec)
        out += 2 * z.a * hkv * (spec.head_dim + spec.v_dim) * (z.e + 4)
    if last:
        out += z.n * spec.vocab * (z.e + 4)
    return out


def _time(est, spec, dims, z, dev, ranks, gpn, knobs, per_rank, param_dtype) -> None:
    """Fills est.times, traffic, collectives, step time, tokens/s, MFU."""
    clock = _Clock(dev, dims, gpn)
    fb, flops_rank = [], []
    for layers, _first, last, n_stages in ranks:
        f = b = flops = 0.0
        for moe, count in Counter(spec.is_moe(i) for i in layers).items():
            layer = next(i for i in layers if spec.is_moe(i) == moe)  # one of the kind
            bf, bb, fl = block_times(spec, layer, z, dev, clock, est.checkpointing, knobs)
            f, b, flops = f + count * bf, b + count * bb, flops + count * fl
        if last:
            head = _gemm_s(dev, z.n, spec.vocab, spec.d_model)
            f, b, flops = f + head, b + 2 * head, flops + 2 * z.n * spec.vocab * spec.d_model
        fb.append((f / n_stages, b / n_stages))
        flops_rank.append(flops)
    m = est.microbatches
    worst = max(range(len(ranks)), key=lambda r: sum(fb[r]))
    f, b = fb[worst]
    if dims.pp > 1:
        send = clock.comm("pp", z.n * spec.d_model * z.e, calls=1, kind="p2p")
        _, bubble = _pipeline(est.schedule, dims.pp, m, per_rank, _round(b / f), _round(send / f))
        # the worst rank's own work, stretched by the simulated bubble (rounding the
        # ratios moves the bubble a little, never the work)
        pipeline = m * ranks[worst][3] * (f + b) / (1 - bubble)
        est.times["bubble"] = bubble
    else:
        pipeline = m * (f + b) * ranks[0][3]
    layers, first, last, _ = ranks[worst]
    state = state_bytes(
        spec, dims, layers, first, last, param_dtype=param_dtype, optimizer=knobs["optimizer"]
    )
    ledger = _ledger(
        spec,
        dims,
        z,
        ranks,
        worst,
        m,
        schedule=est.schedule,
        per_rank=per_rank,
        param_dtype=param_dtype,
        sharding=knobs["dp_sharding"],
        policy=est.checkpointing,
    )
    exposed = 0.0
    if dims.dp > 1:  # FSDP2: the parameters gathered, the gradients reduce-scattered
        sharding = knobs["dp_sharding"]
        gathers = {"zero3": 2 * m, "zero2": m, "zero1": 1}[sharding]
        scatters = 1 if sharding == "zero1" else m
        blocks = max(len(layers), 1)
        unsharded = state["numel"] * dims.dp
        ag = clock.comm("dp", gathers * unsharded * z.e, calls=gathers * blocks)
        rs = clock.comm("dp", scatters * unsharded * REDUCE_BYTES, calls=scatters * blocks)
        # each block's share hides under a block's compute; the first and last do not
        per_block = pipeline / (blocks * m)
        exposed = (
            max(0.0, (ag + rs) / (blocks * m) - per_block) * blocks * m
            + (ag / gathers + rs / scatters) / blocks
        )
    # the partial gradients' all-reduces (the ledger's, each on its group's link), after
    # the step's last backward
    reduce_s = sum(
        clock.group_comm(axes, ledger.bytes[kind, axes], ledger.counts[kind, axes])
        for kind, axes in ledger.bytes
        if kind == "all_reduce"
    )
    words = OPTIMIZER_WORDS[knobs["optimizer"]]
    optimizer_s = words * _bytes(param_dtype) * state["numel"] / (dev.hbm_tbps * 1e12)
    est.step_time_s = pipeline + exposed + reduce_s + optimizer_s
    est.times.update(
        {
            "forward_per_microbatch": f,
            "backward_per_microbatch": b,
            "pipeline": pipeline,
            "exposed_dp": exposed,
            "gradient_all_reduce": reduce_s,
            "optimizer": optimizer_s,
        }
    )
    est.traffic, est.collectives = ledger.sent()
    tokens = est.seq_len * est.micro_batch * m * dims.dp
    gpus = est.gpus
    est.tokens_per_s_per_gpu = tokens / est.step_time_s / gpus
    model_flops = 3 * sum(flops_rank) * m * dims.dp * dims.cp * dims.ulysses * dims.tp
    est.mfu = model_flops / (est.step_time_s * gpus * dev.peak_tflops * 1e12)
    if est.mfu > 1.0:  # every FLOP is timed at a rate at most the peak: a bug if not
        raise AssertionError(
            f"{est.layout()}: MFU {est.mfu:.1%} on {dev.name} ({dev.peak_tflops:g} TFLOP/s): "
            "the time model ran some FLOPs faster than the peak (a Device efficiency above 1?)"
        )
