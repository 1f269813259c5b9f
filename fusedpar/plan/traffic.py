"""The collectives one rank runs in a training step, each with the bytes of the tensors it
is given (as `fusedpar.testing.Collectives` counts them), from the layers' sizes; held
equal to a real step's by tests/plan/test_plan.py.

Per block and microbatch (n, m, a as in `accounting`; e the activations' bytes, 4 for
the fp32 partial sums TP's reduce-scatters and the ring's dK/dV carry): TP's ring sends
per projection and the backward's re-gathers, the ring's K/V and fp32 dK/dV (MLA's: the
latent and k_rope), Ulysses' four all-to-alls, EP's counts and rows, the pipeline's
sends, and one all-reduce over tp per bias after a TP reduction. Once a step: one
all-reduce of partial gradients per group they are partial over; under FSDP2 each unit's
all-gathers and reduce-scatter per microbatch (experts over dp ranks: `memory.fsdp_units`'
units, and the MoE's router and shared expert all-reduced over "dp_in_ep" before its
reduce-scatter over "dp_mod_ep"). The table, op by op: docs/plan.md.

On a CPU (gloo) the ring and Ulysses' exchanges add a small all-gather per call that
checks the ranks agree on shapes (`cpu_checks`); on GPUs they do not.
"""

from __future__ import annotations

import math
from collections import Counter

from fusedpar.plan import accounting as acc
from fusedpar.plan.linear_traffic import linear_context
from fusedpar.plan.memory import PipelineRank, fsdp_units, root_shapes

ACCUMULATE = 4  # fp32 partial sums


class Ledger:
    """Counts and bytes by (kind, axes), axes a tuple of mesh axes (their product the
    group)."""

    def __init__(self, dims):
        self.dims = dims
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def add(self, kind, axes, nbytes, count=1):
        self.add_total(kind, axes, nbytes * count, count)

    def add_total(self, kind, axes, total, count):
        """`count` collectives of `total` bytes in all (parameters of several sizes)."""
        axes = tuple(a for a in axes if self.size(a) > 1)
        if not axes or count <= 0:
            return
        self.counts[kind, axes] += count
        self.bytes[kind, axes] += total

    def size(self, axis) -> int:
        return self.dims.ep_size if axis == "ep" else self.dims.degree(axis)

    def group_size(self, axes) -> int:
        return math.prod(self.size(a) for a in axes)

    def sent(self) -> tuple[dict, dict]:
        """(bytes sent, calls) per group ("cp x tp", say): what each collective puts on
        the wire from one rank (ring algorithms: an all-gather or reduce-scatter sends
        W - 1 of its W shards; an all-reduce twice that; an all-to-all all but its own
        share; a send its tensor)."""
        sent, calls = Counter(), Counter()
        for (kind, axes), given in self.bytes.items():
            w, name = self.group_size(axes), " x ".join(axes)
            share = {
                "all_gather": (w - 1) / (w + 1),
                "reduce_scatter": (w - 1) / (w + 1),
                "all_reduce": 2 * (w - 1) / w,
                "all_to_all": (w - 1) / (2 * w),
                "send": 1.0,
                "recv": 0.0,
            }[kind]
            sent[name] += given * share
            if kind != "recv":
                calls[name] += self.counts[kind, axes]
        return dict(sent), dict(calls)

    def by_group_size(self) -> tuple[dict, dict]:
        """(counts, bytes) keyed (kind, group size), as `Collectives` keys them."""
        counts, nbytes = Counter(), Counter()
        for (kind, axes), n in self.counts.items():
            counts[kind, self.group_size(axes)] += n
            nbytes[kind, self.group_size(axes)] += self.bytes[kind, axes]
        return dict(counts), dict(nbytes)


def _p2p(ledger, axis, nbytes, count):
    ledger.add("send", (axis,), nbytes, count)
    ledger.add("recv", (axis,), nbytes, count)


def block(
    ledger: Ledger, spec, layer: int, z: acc.Local, *, cpu_checks: bool, policy: str = "none"
) -> None:
    """One block's collectives for one microbatch, forward and backward. Under "full"
    checkpointing the forward's run twice (its recompute); `fp.checkpoint_policy()`
    keeps every communicating op's output, so "selective" repeats none but MLA's latent
    ring's (no op the policy names)."""
    for _ in range(2 if policy == "full" else 1):
        _block(ledger, spec, layer, z, cpu_checks=cpu_checks, forward=True)
    if policy == "selective" and _latent(spec, z):  # the policy names no latent-ring op
        _ring(ledger, spec, z, cpu_checks=cpu_checks, forward=True)
    _block(ledger, spec, layer, z, cpu_checks=cpu_checks, forward=False)


def _latent(spec, z) -> bool:
    return spec.mla and z.latent_ring and z.cp > 1


def _ring(ledger, spec, z, *, cpu_checks: bool, forward: bool) -> None:
    """The ring's sends for one block (cp > 1): K and V blocks (c - 1 each way, the
    backward's dK and dV home in c steps, fp32), or MLA's latent with k_rope; on a CPU
    a shape check per forward."""
    c, e = z.cp, z.e
    if _latent(spec, z):
        sizes = (z.a * (spec.kv_lora_rank + spec.rope_dim),)
    else:
        _, hkv = z.heads(spec)
        sizes = (z.a * hkv * spec.head_dim, z.a * hkv * spec.v_dim)
    for size in sizes:
        _p2p(ledger, "cp", size * e, c - 1)  # the blocks
        if not forward:
            _p2p(ledger, "cp", size * ACCUMULATE, c)  # their gradients, home after c steps
    if cpu_checks and forward:  # q's, k's (the latent's) and v's (w's) shapes
        ledger.add("all_gather", ("cp",), (c + 1) * 9 * 8)


def _block(ledger, spec, layer, z, *, cpu_checks: bool, forward: bool) -> None:
    """One block's forward (`forward`) or backward collectives for one microbatch."""
    d, e, hd, hv = spec.d_model, z.e, spec.head_dim, spec.v_dim
    moe = spec.is_moe(layer)
    t, c, u = z.tp, z.cp, z.ulysses
    if t > 1:  # rings: (gathered input?) per projection
        projections = (True, False) if moe else (True, False, True, False)
        for gathered in projections:
            if forward:  # x's chunks, or fp32 partials
                _p2p(ledger, "tp", z.n * d * (e if gathered else ACCUMULATE), t - 1)
                continue
            _p2p(ledger, "tp", z.n * d * (ACCUMULATE if gathered else e), t - 1)  # dX or dY
            if gathered:  # x re-gathered for the weights' gradient: output + input
                ledger.add("all_gather", ("tp",), (z.m + z.n) * d * e)
    if spec.is_linear(layer) and c * u > 1:  # GDN: its halos, summaries or head exchanges
        linear_context(ledger, spec, z, cpu_checks=cpu_checks, forward=forward)
    elif c > 1:
        _ring(ledger, spec, z, cpu_checks=cpu_checks, forward=forward)
    if u > 1 and not spec.is_linear(layer):
        q = z.m * spec.n_heads // t * hd * e  # TP's gathered tokens, this rank's heads
        kv = acc.kv_heads_exchanged(spec, t, u)  # (repeated where fewer than u)
        k, v = z.m * kv * hd * e, z.m * kv * hv * e
        out = z.m * spec.n_heads // t * hv * e
        for size in (q, k, v, out):
            ledger.add("all_to_all", ("ulysses",), 2 * size)  # output + input
        if cpu_checks:  # scatter's 3 shapes and gather's 1
            ledger.add("all_gather", ("ulysses",), (u + 1) * 8 * 12)
            ledger.add("all_gather", ("ulysses",), (u + 1) * 8 * 4)
    if t > 1 and not forward:  # `copy_to_region`: a bias added after a reduction
        for shape, kind in acc.layer_tensors(spec, layer):
            if kind == "summed":
                ledger.add("all_reduce", ("tp",), math.prod(shape) * e)
    if moe and z.ep > 1:
        ep = ("ep",)
        if forward:
            ledger.add("all_to_all", ep, 2 * 8 * spec.num_experts)  # the counts
        rows = z.n * spec.top_k * d * e  # balanced routing: as many rows back as out
        ledger.add("all_to_all", ep, 2 * rows, 2)  # dispatch and return (or their grads)


def _partial_groups(spec, dims, layers, first, last) -> dict:
    """{(axes a gradient is partial over, bucketed): [parameters, their elements]} for one
    rank; bucketed: experts FSDP2 leaves alone (EP over all of dp), which
    `fusedpar.distribute` reduces in one bucket a backward under FSDP2 too."""
    ignored = 1 < dims.dp == dims.ep_dp
    split = tuple(a for a in ("cp", "ulysses", "tp") if getattr(dims, a) > 1)
    without_tp = tuple(a for a in split if a != "tp")
    of_kind = {
        "whole": split,
        "tp": without_tp,
        "summed": without_tp,
        "expert": tuple(a for a in split if a not in dims.ep_axes),
    }
    groups: dict = {}

    def add(key, numel, count):
        entry = groups.setdefault(key, [0, 0])
        entry[0] += count
        entry[1] += count * numel

    for layer, count in _by_kind(spec, layers):
        for shape, kind in acc.layer_tensors(spec, layer, dims.tp, dims.ep_size):
            add((of_kind[kind], ignored and kind == "expert"), math.prod(shape), count)
    for numel, _ in acc.model_end_tensors(spec, first=first, last=last):
        add((split, False), numel, 1)
    return {key: entry for key, entry in groups.items() if key[0]}


def _by_kind(spec, layers) -> list[tuple[int, int]]:
    """(a block of each kind among `layers`, how many of that kind): blocks of one kind
    hold and send alike."""
    kinds = Counter(spec.kind(i) for i in layers)
    return [(next(i for i in layers if spec.kind(i) == k), n) for k, n in kinds.items()]


def step(
    spec,
    dims,
    z: acc.Local,
    rank: PipelineRank,
    microbatches: int,
    *,
    policy: str = "none",
    dp_sharding: str = "zero3",
    grad_bytes: int = 4,
    gather_bytes: int | None = None,
    cpu_checks: bool = False,
) -> Ledger:
    """One pipeline rank's collectives in a step: `microbatches` of its blocks (and the
    embedding / head: `rank`, as `memory.rank_stages` gives it), the pipeline's sends
    between its stages and other ranks', the gradients' reductions. With dp > 1, FSDP2
    over dp, each block a unit and the root another, resharding as `dp_sharding` says
    (`estimate`), gathering `gather_bytes` an element (a MixedPrecisionPolicy's
    param_dtype; default `grad_bytes`: the parameters as held) and reducing `grad_bytes`."""
    layers, first, last = rank.layers, rank.first, rank.last
    ledger = Ledger(dims)
    fsdp = dims.dp > 1
    kinds = Counter(spec.kind(i) for i in layers)
    for kind, count in kinds.items():
        one = Ledger(dims)
        block(
            one,
            spec,
            next(i for i in layers if spec.kind(i) == kind),
            z,
            cpu_checks=cpu_checks,
            policy=policy,
        )
        for key in one.counts:
            ledger.counts[key] += one.counts[key] * count * microbatches
            ledger.bytes[key] += one.bytes[key] * count * microbatches
    if dims.pp > 1:
        owner, me = rank.stage_ranks, rank.stage_ranks[rank.stages[0]]
        hidden = z.n * spec.d_model * z.e
        for s in rank.stages:
            for neighbour in (s - 1, s + 1):
                if 0 <= neighbour < len(owner) and owner[neighbour] != me:
                    _p2p(ledger, "pp", hidden, microbatches)  # activation or its gradient
    if spec.hf and last and dims.pp == 1:  # `parallelize`'s loss: (sum, count) in fp32
        for axis in ("cp", "ulysses", "tp"):
            ledger.add("all_reduce", (axis,), 8, microbatches)
    for (axes, bucketed), (params, numel) in _partial_groups(
        spec, dims, layers, first, last
    ).items():  # under FSDP2 each parameter alone, but those it ignores; else one bucket
        if fsdp and bucketed:  # (at the end of each backward)
            ledger.add("all_reduce", axes, numel * grad_bytes, microbatches)
        else:
            ledger.add_total("all_reduce", axes, numel * grad_bytes, params if fsdp else 1)
    if fsdp:
        kinds = _by_kind(spec, layers)
        units = [(g, t, False, n) for i, n in kinds for g, t in fsdp_units(spec, dims, i)]
        units.append(("dp", [(s, "whole") for s in root_shapes(spec, rank)], True, 1))
        per_step = {
            "zero3": (2 * microbatches, microbatches),
            "zero2": (microbatches,) * 2,
            "zero1": (1, 1),
        }[dp_sharding]  # (a block's gathers, its scatters)
        for group, tensors, root, count in units:
            if group is None:  # experts FSDP2 leaves alone (EP over all of dp)
                continue
            w = dims.degree(group)
            shard = sum(acc.fsdp_numel(s, w) for s, _ in tensors)
            gathers, scatters = (n * count for n in per_step)
            if root and dp_sharding == "zero3":  # the root is not resharded after forward
                gathers = microbatches
            if shard:
                gathered = shard * (w + 1) * (gather_bytes or grad_bytes)
                ledger.add("all_gather", (group,), gathered, gathers)
                ledger.add("reduce_scatter", (group,), shard * (w + 1) * grad_bytes, scatters)
            if group == "dp_mod_ep":  # FSDP2 first sums the MoE's router and shared expert
                # over the EP group's dp ranks, one parameter at a time
                shared = [math.prod(s) for s, kind in tensors if kind != "expert"]
                total = sum(shared) * grad_bytes * scatters
                ledger.add_total("all_reduce", ("dp_in_ep",), total, len(shared) * scatters)
    return ledger
