"""One layout's estimate: memory by part (`memory`, from `accounting`, which the tests hold
equal to the code), traffic and collectives per mesh axis (`traffic`), and the step time.

The time model, per rank and microbatch, for each block of its stages: GEMMs at the
measured TFLOP/s of the nearest shape (bench/results/<device>/matmul.json, else a
stated fraction of peak: `devices`); attention at the measured fwd+bwd rate of the
nearest (S, D); element-wise work as saved bytes moved at HBM bandwidth; recompute per
policy; TP's collectives hidden under their GEMMs but one chunk, the ring's steps under
their blocks, Ulysses' and EP's all-to-alls exposed, FSDP2's gathers prefetched under
the previous block; the pipeline bubble simulated on torch's action lists
(`schedule.simulate`); AdamW at HBM bandwidth.

Collectives take bytes x (W - 1) / W (all-reduce twice that) over the group's link
(NVLink when its ranks share a node: mesh order (pp, dp, cp, ulysses, tp), tp innermost;
an EP group over dp ranks is the inner dp ranks times its other axes: `link_of`) plus a
latency each. See docs/plan.md for where it misses, and by how much.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from fusedpar.axes import DP_PARTS
from fusedpar.parallel import ParallelDims
from fusedpar.pipeline import check_pipeline, stage_count
from fusedpar.plan import accounting as acc
from fusedpar.plan import devices, memory, traffic
from fusedpar.plan.memory import REDUCE_BYTES, PipelineRank, element_bytes, latent_ring
from fusedpar.plan.model import model_spec
from fusedpar.plan.schedule import simulate, simulated_count

LATENCY_S = {"nvlink": 10e-6, "network": 25e-6}  # per collective
DP_SHARDING = ("zero3", "zero2", "zero1")
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
            "dims": {a: getattr(d, a) for a in AXES}
            | {"ep": list(d.ep_axes), "ep_degree": d.ep_degree},
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


@dataclass(frozen=True)
class StepOptions:
    """A step's choices beyond the layout and the sizes, `estimate`'s keywords of these
    names made once (`document_len` None: each sequence one document)."""

    microbatches: int
    schedule: str | None
    stages_per_rank: int
    checkpointing: str
    dp_sharding: str
    optimizer: str
    param_dtype: torch.dtype
    overlap: str
    elementwise_passes: float
    document_len: int | None


def mesh_order(dims: ParallelDims) -> list[tuple[str, int]]:
    """(axis, degree) of the mesh, outermost first: dp as its two parts ("dp_mod_ep"
    outer, "dp_in_ep" inner) where the EP group takes part of it (`splits_dp`)."""
    dp = [(a, dims.degree(a)) for a in DP_PARTS] if dims.splits_dp else [("dp", dims.dp)]
    rest = [(a, getattr(dims, a)) for a in AXES[2:]]
    return [("pp", dims.pp), *dp, *rest]


def group_axes(dims: ParallelDims, names) -> tuple[str, ...]:
    """The mesh axes of the group over `names` (fusedpar's axes, `DP_PARTS`, or "ep": its
    axes, the inner part of dp where the EP group takes part of it)."""
    out = []
    for name in (names,) if isinstance(names, str) else names:
        if name == "ep":
            out += ["dp_in_ep" if a == "dp" and dims.splits_dp else a for a in dims.ep_axes]
        elif name == "dp" and dims.splits_dp:
            out += DP_PARTS
        else:
            out.append(name)
    return tuple(out)


def link_of(dims: ParallelDims, axes, gpus_per_node: int) -> str:
    """ "nvlink" when the ranks of the group over `axes` (`group_axes`' names) share a
    node: a group lies within the consecutive ranks its outermost axis spans (mesh
    order, tp innermost); an EP group over dp ranks is the inner dp ranks times its
    other axes."""
    names, order = group_axes(dims, axes), mesh_order(dims)
    first = min(i for i, (a, _) in enumerate(order) if a in names)
    span = math.prod(n for _, n in order[first:])
    return "nvlink" if gpus_per_node % span == 0 else "network"


def group_size(dims: ParallelDims, names) -> int:
    """The ranks of the group over `names` (as `group_axes` takes them)."""
    return math.prod(dims.ep_size if n == "ep" else dims.degree(n) for n in names)


class _Clock:
    """The time collectives take on a layout's links. The gradients' all-reduces are
    timed from `traffic.step`'s ledger (`group_comm`); the per-block terms follow the
    same formulas for the bytes that overlap with compute."""

    def __init__(self, dev, dims, gpn):
        self.dev, self.dims, self.gpn = dev, dims, gpn

    def comm(self, axis: str, nbytes: float, calls: int = 1, kind: str = "ring") -> float:
        """Seconds for `calls` collectives moving `nbytes` in all over `axis`."""
        size = group_size(self.dims, (axis,))
        if size <= 1 or nbytes <= 0:
            return 0.0
        link = link_of(self.dims, axis, self.gpn)
        sent = nbytes * (size - 1) / size * (2 if kind == "all_reduce" else 1)
        if kind == "p2p":
            sent = nbytes
        bw = (self.dev.nvlink_gbps if link == "nvlink" else self.dev.network_gbps) * 1e9
        return sent / bw + calls * LATENCY_S[link]

    def group_comm(self, axes: tuple, given: float, calls: int) -> float:
        """Seconds for an all-reduce of `given` bytes in all over the group of `axes`,
        on the link of its outermost axis."""
        size = group_size(self.dims, axes)
        if size <= 1:
            return 0.0
        link = link_of(self.dims, axes, self.gpn)
        bw = (self.dev.nvlink_gbps if link == "nvlink" else self.dev.network_gbps) * 1e9
        return given * 2 * (size - 1) / size / bw + calls * LATENCY_S[link]


def _gemm_s(dev, rows, out, inner) -> float:
    if rows <= 0:
        return 0.0
    tflops, _ = devices.gemm_tflops(dev, rows, out, inner)
    return 2 * rows * out * inner / (tflops * 1e12)


GDN_CHUNK = 64  # the chunked algorithm's chunk (fp.gated_delta_rule's)


def gdn_widths(spec, tp: int) -> tuple[int, int]:
    """(outputs of GDN's input projections, inputs of its out projection) on one TP rank:
    q, k (hk K each), v, z (hv V each), b, a (hv each); o reads hv V."""
    hk, hv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    K, V = spec.linear_k_dim, spec.linear_v_dim
    return 2 * hk * K + 2 * hv * V + 2 * hv, hv * V


def gdn_recurrence_flops(spec, tokens: int, tp: int) -> float:
    """Forward FLOPs of the chunked gated delta rule over `tokens` on one TP rank (its
    hv v-heads; each reads its k-head, GVA). Per v-head and token, chunk C (64):
    within a chunk, k k^T (2 C K), the WY/UT pair W = T beta k and U = T beta v
    (2 C K + 2 C V; the C x C triangular solve, C^2 / 3, left out) and the masked
    q k^T and its product with U - W S (2 C K + 2 C V); across chunks, W S, q S and
    the state's update k^T (U - W S) (2 K V each). So 6 K V + 2 C (3 K + 2 V): at
    K = V = d, 6 d^2 + 10 C d, flash-linear-attention's count. The conv (2 W a
    channel), the gates and the gated norm are element-wise (timed by their bytes)."""
    K, V, C = spec.linear_k_dim, spec.linear_v_dim, GDN_CHUNK
    return tokens * spec.linear_v_heads // tp * (6 * K * V + 2 * C * (3 * K + 2 * V))


def block_times(spec, layer, z: acc.Local, clock: _Clock, opts: StepOptions) -> tuple:
    """(forward s, backward s, GEMM+attention FLOPs fwd) of one block, one microbatch,
    exposed communication included (timed on `clock`, on its device)."""
    dev, policy = clock.dev, opts.checkpointing
    d, hd, hv, e = spec.d_model, spec.head_dim, spec.v_dim, z.e
    hq, hkv = z.heads(spec)
    moe = spec.is_moe(layer)
    # GEMMs: the attention projections over TP's gathered tokens, the MLP's
    # (replicated KV heads: a rank projects its own one)
    proj_flops_in = spec.n_heads // z.tp * hd * (2 if spec.output_gate else 1)
    proj_flops_in += 2 * acc.kv_heads_held(spec, z.tp) * hd
    o_in = spec.n_heads * hv // z.tp
    if spec.is_linear(layer):  # GDN: q, k, v, z, b, a from one gather; o from hv V
        proj_flops_in, o_in = gdn_widths(spec, z.tp)
    qkv = _gemm_s(dev, z.m, proj_flops_in, d)
    o = _gemm_s(dev, z.m, d, o_in)
    flops = 2 * z.m * d * (proj_flops_in + o_in)
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
    document = min(opts.document_len or z.seq, z.seq)
    att_flops = 2 * z.a * (document / 2) * hq * (hd + hv)
    att_rate, _ = devices.attention_tflops(dev, document, hd, True)
    if spec.is_linear(layer):  # the chunked recurrence, linear in the tokens
        att_flops = gdn_recurrence_flops(spec, z.m, z.tp)
        att_rate = dev.peak_tflops * dev.attention_efficiency
    attention = 3.5 * att_flops / (att_rate * 1e12)  # fwd + bwd, at the fwd+bwd rate
    att_f, att_b = attention / 3.5, attention * 2.5 / 3.5
    flops += att_flops
    saved = acc.block_saved(spec, layer, z, "none")
    elementwise = opts.elementwise_passes * saved / (dev.hbm_tbps * 1e12)
    fwd = gemm + att_f + elementwise
    bwd = 2 * gemm + att_b + 2 * elementwise
    if policy == "selective":  # what `fp.checkpoint_policy` recomputes (recompute.py)
        bwd += elementwise + (mlp_in + mlp_out if moe else 0.0)  # the experts' GEMMs
        if (z.tp > 1 and z.cp == 1) or z.ulysses > 1 or spec.is_linear(layer):
            bwd += att_f  # attention no exchange keeps; GDN's recurrence, never kept
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
            if opts.overlap == "serial":
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
        kv = acc.kv_heads_exchanged(spec, z.tp, z.ulysses) * (hd + hv)
        moved = z.m * (spec.n_heads // z.tp * (hd + hv) + kv) * e
        t = clock.comm("ulysses", moved, calls=4, kind="all_to_all")
        fwd, bwd = fwd + t, bwd + clock.comm("ulysses", moved, calls=4, kind="all_to_all")
    if moe and z.ep > 1:  # dispatch and return (and their counts), both passes
        rows_bytes = z.n * spec.top_k * d * e
        fwd += clock.comm("ep", 2 * rows_bytes, calls=3, kind="all_to_all")
        bwd += clock.comm("ep", 2 * rows_bytes, calls=2, kind="all_to_all")
    if moe and clock.dims.ep_dp > 1:  # experts over dp ranks: their gradient scaled by
        # 1 / ep_dp each microbatch, an element-wise pass (read and write)
        experts = 3 * spec.num_experts // z.ep * spec.expert_hidden * d
        bwd += 2 * experts * e / (dev.hbm_tbps * 1e12)
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
        n_kv_heads=acc.check_heads(spec, dims),
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
        element_bytes(dtype),
        latent_ring=latent_ring(spec, dims, cp_ring),
    )
    opts = StepOptions(
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        checkpointing=checkpointing,
        dp_sharding=dp_sharding,
        optimizer=optimizer,
        param_dtype=param_dtype,
        overlap=overlap,
        elementwise_passes=elementwise_passes,
        document_len=document_len,
    )
    est = Estimate(
        spec.name, dims, seq_len, micro_batch, microbatches, schedule, checkpointing, dp_sharding
    )
    est.experts, est.stages_per_rank = spec.num_experts, stages_per_rank
    ranks = memory.rank_stages(spec, dims, schedule, stages_per_rank)
    best = est.memory = memory.largest(spec, dims, z, ranks, opts)
    est.fits = best["peak"] <= memory_margin * dev.memory_bytes
    if not est.fits:
        short = best["peak"] - memory_margin * dev.memory_bytes
        est.notes.append(
            f"out of memory by {short / 1e9:.1f} GB "
            f"(peak {best['peak'] / 1e9:.1f} GB, {memory_margin:.0%} of "
            f"{dev.memory_gb:g} GB usable)"
        )
    _time(est, spec, z, _Clock(dev, dims, gpus_per_node), ranks, opts)
    for group in est.traffic:  # the link of its outermost axis
        est.links[group] = link_of(dims, group.split(" x "), gpus_per_node)
    return est


def _round(x: float) -> float:
    """`x` to 2 significant digits: pipeline bubbles are cached by these ratios."""
    return float(f"{x:.2g}")


# words an optimizer step reads and writes a parameter: AdamW p, g, m, v in and p, m, v
# out; plain SGD p, g in and p out
OPTIMIZER_WORDS = {"adamw": 7, "sgd": 3}


@lru_cache(maxsize=4096)
def _pipeline(schedule, pp, microbatches, per_rank, backward, send) -> tuple[float, float]:
    """(step / forward, bubble) of the schedule at these ratios to the forward's time
    (`schedule.simulate`; a step's time scales with the three). Past the simulated count
    each microbatch adds its stages' forward and backward to the step."""
    simulated = simulated_count(schedule, pp, microbatches, per_rank)
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


def _time(est, spec, z, clock: _Clock, ranks: list[PipelineRank], opts: StepOptions) -> None:
    """Fills est.times, traffic, collectives, step time, tokens/s, MFU (on `clock`'s
    device and links)."""
    dev, dims = clock.dev, clock.dims
    fb, flops_rank = [], []
    for rank in ranks:
        f = b = flops = 0.0
        for kind, count in Counter(spec.kind(i) for i in rank.layers).items():
            layer = next(i for i in rank.layers if spec.kind(i) == kind)  # one of the kind
            bf, bb, fl = block_times(spec, layer, z, clock, opts)
            f, b, flops = f + count * bf, b + count * bb, flops + count * fl
        if rank.last:
            head = _gemm_s(dev, z.n, spec.vocab, spec.d_model)
            f, b, flops = f + head, b + 2 * head, flops + 2 * z.n * spec.vocab * spec.d_model
        n_stages = len(rank.stages)
        fb.append((f / n_stages, b / n_stages))
        flops_rank.append(flops)
    m = opts.microbatches
    worst = max(range(len(ranks)), key=lambda r: sum(fb[r]))
    f, b = fb[worst]
    if dims.pp > 1:
        send = clock.comm("pp", z.n * spec.d_model * z.e, calls=1, kind="p2p")
        ratios = _round(b / f), _round(send / f)
        _, bubble = _pipeline(opts.schedule, dims.pp, m, opts.stages_per_rank, *ratios)
        # the worst rank's own work, stretched by the simulated bubble (rounding the
        # ratios moves the bubble a little, never the work)
        pipeline = m * len(ranks[worst].stages) * (f + b) / (1 - bubble)
        est.times["bubble"] = bubble
    else:
        pipeline = m * (f + b) * len(ranks[0].stages)
    state = memory.state_bytes(
        spec, dims, ranks[worst], param_dtype=opts.param_dtype, optimizer=opts.optimizer
    )
    # the collectives of one step on the worst rank (the ledger tests/plan/test_plan.py
    # holds equal to a real step's)
    ledger = traffic.step(
        spec,
        dims,
        z,
        ranks[worst],
        m,
        policy=opts.checkpointing,
        dp_sharding=opts.dp_sharding,
        grad_bytes=REDUCE_BYTES,
        gather_bytes=z.e,
    )
    exposed = 0.0
    if dims.dp > 1:  # FSDP2: the parameters gathered, the gradients reduce-scattered
        sharding = opts.dp_sharding
        gathers = {"zero3": 2 * m, "zero2": m, "zero1": 1}[sharding]
        scatters = 1 if sharding == "zero1" else m
        blocks = max(len(ranks[worst].layers), 1)
        ag = rs = 0.0
        for group, (_, units, whole) in memory.dp_shards(spec, dims, ranks[worst]).items():
            if group is None:  # experts FSDP2 leaves alone (EP over all of dp)
                continue
            units = max(units, 1)
            ag += clock.comm(group, gathers * whole * z.e, calls=gathers * units)
            rs += clock.comm(group, scatters * whole * REDUCE_BYTES, calls=scatters * units)
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
    words = OPTIMIZER_WORDS[opts.optimizer]
    optimizer_s = words * element_bytes(opts.param_dtype) * state["numel"] / (dev.hbm_tbps * 1e12)
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
