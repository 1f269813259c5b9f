"""A search's outputs: the ranked table (markdown), JSON, the memory/step-time plot with
its frontier, and the command line that runs the top pick's layout on the demo model
(or what the demo cannot run of it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fusedpar.parallel import ParallelDims
from fusedpar.pipeline import SCHEDULES, stage_count
from fusedpar.plan.estimate import Estimate

GB = 1e9
SHARDING_NOTE = {
    "zero3": "fully_shard's defaults",
    "zero2": "reshard_after_forward=False",
    "zero1": "reshard_after_forward=False, set_reshard_after_backward(False), "
    "no gradient sync but in the last microbatch",
}


def dims_call(est: Estimate) -> str:
    """The ``fp.ParallelDims(...)`` call of `est`'s layout."""
    d = est.dims
    axes = ("dp", "cp", "tp", "ulysses", "pp")
    args = [f"{a}={getattr(d, a)}" for a in axes if getattr(d, a) > 1]
    if d.ep_axes:
        args.append(f"ep={d.ep!r}")
    if d.ep_degree is not None:
        args.append(f"ep_degree={d.ep_degree}")
    return f"fp.ParallelDims({', '.join(args)})"


# examples/train.py's model (examples/tiny_llama.py's Config) and its defaults: what the
# demo's flags leave fixed (tests/plan/test_plan_time.py holds them to the example's)
DEMO_HEADS, DEMO_KV_HEADS, DEMO_EXPERTS = 4, 2, 4


def demo(est: Estimate, gpus_per_node: int = 8, script: str = "examples/train.py"):
    """(the ``torchrun`` line that runs `est`'s layout on the demo model, or None; notes).

    The demo (examples/train.py: its own small model) takes the degrees (--tp, --cp,
    --ulysses, --pp; dp is the rest), a pipeline's schedule and microbatches, experts
    (--moe) over the axes --ep names (tp by default; dp ranks too, --ep-degree for part
    of dp), the sequence length and the global batch (--batch: sequences a step, split
    over dp). What it cannot run is a note instead of a command: every expert on each
    rank while tp > 1 (no EP), microbatches without a pipeline (no
    gradient accumulation), FSDP2 holding parameters through the step (zero1, zero2: the demo
    reshards after each forward), degrees its 4 heads and 2 KV heads do not split into,
    or GPUs torchrun cannot spread evenly over nodes. A note beside a command says what
    it runs otherwise (no activation checkpointing). A model of your own takes the
    layout's degrees: `dims_call`."""
    d = est.dims
    nodes = -(-est.gpus // gpus_per_node)
    per_node = est.gpus // nodes
    missing, notes = [], []
    if nodes * per_node != est.gpus:
        missing.append(
            f"{est.gpus} GPUs do not spread evenly over {nodes} nodes of at most {gpus_per_node}"
        )
    flags = [f"--{a} {getattr(d, a)}" for a in ("tp", "cp", "ulysses", "pp") if getattr(d, a) > 1]
    layers = microbatches = None
    if d.pp > 1:  # the demo's blocks, one a stage
        try:
            layers = stage_count(est.schedule, d.pp, est.stages_per_rank)
        except ValueError as e:
            missing.append(str(e))
        if est.stages_per_rank != 2 and SCHEDULES.get(est.schedule) != "single":
            missing.append(
                f"{est.stages_per_rank} stages a pipeline rank (the demo's schedules hold 2)"
            )
        microbatches = est.microbatches
        flags += [
            f"--schedule {est.schedule}",
            f"--microbatches {microbatches}",
            f"--layers {layers}",
        ]
    elif est.microbatches > 1:
        missing.append(
            f"{est.microbatches} microbatches of {est.micro_batch} a dp rank (the demo has no "
            "gradient accumulation: without a pipeline it runs a dp rank's batch at once)"
        )
    experts = 0
    ep_axes = d.ep_axes or ("tp",)  # the demo's --ep: tp unless given
    if est.experts:
        if not d.ep_axes and d.tp > 1:
            missing.append(
                f"every expert on each of tp {d.tp} (the demo's --moe splits them over --ep)"
            )
        size = d.ep_size if d.ep_axes else d.tp
        experts = size * -(-DEMO_EXPERTS // size)  # a multiple of the EP degree
        flags.append("--moe")
        if ep_axes != ("tp",):
            flags.append(f"--ep {','.join(ep_axes)}")
        if d.ep_degree is not None:
            flags.append(f"--ep-degree {d.ep_degree}")
        if experts != DEMO_EXPERTS:
            flags.append(f"--experts {experts}")
    elif d.ep_axes:
        missing.append("experts over a dense model")
    if d.dp > 1 and est.dp_sharding != "zero3":
        missing.append(
            f"FSDP2's {est.dp_sharding} ({SHARDING_NOTE[est.dp_sharding]}; the "
            "demo reshards after each forward, zero3)"
        )
    try:  # what the demo itself checks first
        ParallelDims(
            dp=d.dp,
            cp=d.cp,
            tp=d.tp,
            ulysses=d.ulysses,
            pp=d.pp,
            ep=ep_axes if experts else None,
            ep_degree=d.ep_degree if experts else None,
        ).validate(
            est.gpus,
            n_heads=DEMO_HEADS,
            n_kv_heads=DEMO_KV_HEADS,
            num_experts=experts or None,
            seq_len=est.seq_len,
            n_layers=layers or 2,
            microbatches=microbatches,
            schedule=est.schedule or "1F1B",
        )
    except ValueError as e:
        missing.append(f"the demo model ({DEMO_HEADS} heads, {DEMO_KV_HEADS} KV heads): {e}")
    if missing:
        return None, missing
    if est.checkpointing != "none":
        notes.append(f"the demo checkpoints no activations (the plan: {est.checkpointing})")
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}"
    if nodes > 1:
        launch += " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500"
    batch = d.dp * est.micro_batch * est.microbatches  # sequences a step, over dp
    flags += [f"--seq {est.seq_len}", f"--batch {batch}"]
    return " ".join([launch, script, *flags]), notes


def demo_lines(est: Estimate, gpus_per_node: int = 8) -> list[str]:
    """The top pick's demo, as comment and command lines: the command and what it runs
    otherwise, or why the demo cannot run the layout."""
    line, notes = demo(est, gpus_per_node)
    if line is None:
        return ["# the demo model (examples/train.py) cannot run this layout: " + "; ".join(notes)]
    return ["# the demo model at this layout:", line] + [f"# ({note})" for note in notes]


def _row(rank: int, est: Estimate) -> str:
    mem = est.memory
    exposed = est.times.get("exposed_dp", 0.0)
    bubble = est.times.get("bubble")
    return (
        f"| {rank} | {est.layout()} | {est.checkpointing} | {est.dp_sharding} | "
        f"{est.micro_batch} x "
        f"{est.microbatches} | {est.schedule or '-'} | {mem['peak'] / GB:.1f} | "
        f"{(mem['activations'] + mem['in_flight']) / GB:.1f} | {est.step_time_s:.3f} | "
        f"{est.tokens_per_s_per_gpu:,.0f} | {est.mfu:.1%} | "
        f"{'-' if bubble is None else f'{bubble:.0%}'} | {exposed:.3f} |"
    )


def markdown(result, *, top: int = 15, title: str = "", gpus_per_node: int = 8) -> str:
    """The ranked layouts (the `top` fastest that fit), the best try of each layout that
    does not, and why every other one is ruled out."""
    lines = [f"# {title}", ""] if title else []
    head = (
        "| # | layout | checkpointing | FSDP | batch x microbatches | schedule | peak GB | "
        "activations GB | step s | tokens/s/GPU | MFU | bubble | exposed DP s |"
    )
    lines += [head, "|" + " --- |" * 13]
    lines += [_row(i + 1, est) for i, est in enumerate(result.ranked[:top])]
    if result.best is not None:
        best = result.best
        lines += [
            "",
            f"Top pick: {best.layout()} ({best.checkpointing} checkpointing), "
            f"{best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (FSDP2: "
            f"{SHARDING_NOTE[best.dp_sharding]}):",
            "",
            "```",
            *demo_lines(best, gpus_per_node),
            "# your model's degrees:",
            dims_call(best),
            "```",
        ]
        traffic = ", ".join(
            f"{axis} {best.traffic[axis] / GB:.1f} GB in "
            f"{best.collectives[axis]} calls over {best.links.get(axis, '?')}"
            for axis in best.traffic
        )
        lines += ["", f"Its traffic per step and rank: {traffic or 'none'}."]
    if result.ruled_out:
        lines += ["", f"Ruled out ({len(result.ruled_out)}):", ""]
        lines += [f"- {layout}: {why}" for layout, why in result.ruled_out[:top]]
        if len(result.ruled_out) > top:
            lines.append(f"- ... and {len(result.ruled_out) - top} more (in the JSON)")
    return "\n".join(lines) + "\n"


def as_json(result) -> dict:
    return {
        "ranked": [e.as_dict() for e in result.ranked],
        "out_of_memory": [e.as_dict() for e in result.out_of_memory],
        "ruled_out": [{"layout": layout, "why": why} for layout, why in result.ruled_out],
    }


def frontier(estimates: list[Estimate]) -> list[Estimate]:
    """The layouts no other beats on both peak memory and step time, by memory."""
    out, best_time = [], float("inf")
    for est in sorted(estimates, key=lambda e: (e.memory["peak"], e.step_time_s)):
        if est.step_time_s < best_time:
            out.append(est)
            best_time = est.step_time_s
    return out


def plot(result, path, *, title: str = "") -> bool:
    """Peak memory against step time for every layout estimated (those out of memory in
    grey), the frontier drawn, the top pick labelled. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for group, color, label in (
        (result.out_of_memory, "0.7", "out of memory (best try)"),
        (result.ranked, "tab:blue", "fits"),
    ):
        if group:
            ax.scatter(
                [e.step_time_s for e in group],
                [e.memory["peak"] / GB for e in group],
                s=14,
                color=color,
                label=label,
            )
    edge = frontier(result.ranked)
    if edge:
        ax.plot(
            [e.step_time_s for e in edge],
            [e.memory["peak"] / GB for e in edge],
            color="tab:orange",
            label="frontier",
        )
    if result.best is not None:
        b = result.best
        ax.annotate(
            f"top: {b.layout()}",
            (b.step_time_s, b.memory["peak"] / GB),
            xytext=(10, 10),
            textcoords="offset points",
            arrowprops={"arrowstyle": "->"},
        )
    ax.set_xscale("log")  # layouts across nodes' TP run 10x slower: one axis for all
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(
    result, folder, *, name: str = "plan", title: str = "", gpus_per_node: int = 8, top: int = 15
) -> dict:
    """`name`.md, `name`.json and `name`.png in `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "md": folder / f"{name}.md",
        "json": folder / f"{name}.json",
        "png": folder / f"{name}.png",
    }
    paths["md"].write_text(markdown(result, top=top, title=title, gpus_per_node=gpus_per_node))
    paths["json"].write_text(json.dumps(as_json(result), indent=1, default=str))
    if not plot(result, paths["png"], title=title):
        paths.pop("png")
    return paths
