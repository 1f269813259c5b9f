"""A search's outputs: the ranked table (markdown), JSON, the memory/step-time plot with
its frontier, and the command line that runs the top pick."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fusedpar.plan.estimate import Estimate

GB = 1e9
SHARDING_NOTE = {"zero3": "fully_shard's defaults",
                 "zero2": "reshard_after_forward=False",
                 "zero1": "reshard_after_forward=False, set_reshard_after_backward(False), "
                          "no gradient sync but in the last microbatch"}  # fmt: skip


def dims_call(est: Estimate) -> str:
    """The ``fp.ParallelDims(...)`` call of `est`'s layout."""
    d = est.dims
    axes = ("dp", "cp", "tp", "ulysses", "pp")
    args = [f"{a}={getattr(d, a)}" for a in axes if getattr(d, a) > 1]
    if d.ep_axes:
        args.append(f"ep={d.ep!r}")
    return f"fp.ParallelDims({', '.join(args)})"


def command(est: Estimate, gpus_per_node: int = 8, script: str = "examples/train.py") -> str:
    """The ``torchrun`` line that runs `est`'s layout on the demo model
    (examples/train.py: its own small model, at these degrees, schedule and batch; a
    model of your own takes the same degrees: `dims_call`)."""
    from fusedpar.pipeline import stage_count

    d = est.dims
    nodes = -(-est.gpus // gpus_per_node)
    per_node = est.gpus // nodes
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}"
    if nodes > 1:
        launch += " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500"
    flags = [f"--{a} {getattr(d, a)}" for a in ("tp", "cp", "ulysses", "pp") if getattr(d, a) > 1]
    if d.pp > 1:  # the demo's blocks, one a stage
        flags += [f"--schedule {est.schedule}", f"--microbatches {est.microbatches}",
                  f"--layers {stage_count(est.schedule, d.pp)}"]  # fmt: skip
    if d.ep_axes:  # the demo runs its experts over tp
        flags.append("--moe")
    flags += [f"--seq {est.seq_len}", f"--batch {est.micro_batch * est.microbatches}"]
    return " ".join([launch, script, *flags])


def _row(rank: int, est: Estimate) -> str:
    mem = est.memory
    exposed = est.times.get("exposed_dp", 0.0)
    bubble = est.times.get("bubble")
    return (f"| {rank} | {est.layout()} | {est.checkpointing} | {est.dp_sharding} | "
            f"{est.micro_batch} x "
            f"{est.microbatches} | {est.schedule or '-'} | {mem['peak'] / GB:.1f} | "
            f"{(mem['activations'] + mem['in_flight']) / GB:.1f} | {est.step_time_s:.3f} | "
            f"{est.tokens_per_s_per_gpu:,.0f} | {est.mfu:.1%} | "
            f"{'-' if bubble is None else f'{bubble:.0%}'} | {exposed:.3f} |")  # fmt: skip


def markdown(result, *, top: int = 15, title: str = "", gpus_per_node: int = 8) -> str:
    """The ranked layouts (the `top` fastest that fit), the best try of each layout that
    does not, and why every other one is ruled out."""
    lines = [f"# {title}", ""] if title else []
    head = ("| # | layout | checkpointing | FSDP | batch x microbatches | schedule | peak GB | "
            "activations GB | step s | tokens/s/GPU | MFU | bubble | exposed DP s |")  # fmt: skip
    lines += [head, "|" + " --- |" * 13]
    lines += [_row(i + 1, est) for i, est in enumerate(result.ranked[:top])]
    if result.best is not None:
        best = result.best
        lines += ["", f"Top pick: {best.layout()} ({best.checkpointing} checkpointing), "
                  f"{best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (FSDP2: "
                  f"{SHARDING_NOTE[best.dp_sharding]}):", "", "```",
                  f"# the demo model at this layout:\n{command(best, gpus_per_node)}",
                  f"# your model's degrees:\n{dims_call(best)}", "```"]  # fmt: skip
        traffic = ", ".join(f"{axis} {best.traffic[axis] / GB:.1f} GB in "
                            f"{best.collectives[axis]} calls over {best.links.get(axis, '?')}"
                            for axis in best.traffic)  # fmt: skip
        lines += ["", f"Its traffic per step and rank: {traffic or 'none'}."]
    if result.ruled_out:
        lines += ["", f"Ruled out ({len(result.ruled_out)}):", ""]
        lines += [f"- {layout}: {why}" for layout, why in result.ruled_out[:top]]
        if len(result.ruled_out) > top:
            lines.append(f"- ... and {len(result.ruled_out) - top} more (in the JSON)")
    return "\n".join(lines) + "\n"


def as_json(result) -> dict:
    return {"ranked": [e.as_dict() for e in result.ranked],
            "out_of_memory": [e.as_dict() for e in result.out_of_memory],
            "ruled_out": [{"layout": layout, "why": why}
                          for layout, why in result.ruled_out]}  # fmt: skip


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
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')",
              file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for group, color, label in ((result.out_of_memory, "0.7", "out of memory (best try)"),
                                (result.ranked, "tab:blue", "fits")):  # fmt: skip
        if group:
            ax.scatter([e.step_time_s for e in group], [e.memory["peak"] / GB for e in group],
                       s=14, color=color, label=label)  # fmt: skip
    edge = frontier(result.ranked)
    if edge:
        ax.plot([e.step_time_s for e in edge], [e.memory["peak"] / GB for e in edge],
                color="tab:orange", label="frontier")  # fmt: skip
    if result.best is not None:
        b = result.best
        ax.annotate(f"top: {b.layout()}", (b.step_time_s, b.memory["peak"] / GB),
                    xytext=(10, 10), textcoords="offset points",
                    arrowprops={"arrowstyle": "->"})  # fmt: skip
    ax.set_xscale("log")  # layouts across nodes' TP run 10x slower: one axis for all
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(result, folder, *, name: str = "plan", title: str = "", gpus_per_node: int = 8,
          top: int = 15) -> dict:  # fmt: skip
    """`name`.md, `name`.json and `name`.png in `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"md": folder / f"{name}.md", "json": folder / f"{name}.json",
             "png": folder / f"{name}.png"}  # fmt: skip
    paths["md"].write_text(markdown(result, top=top, title=title, gpus_per_node=gpus_per_node))
    paths["json"].write_text(json.dumps(as_json(result), indent=1, default=str))
    if not plot(result, paths["png"], title=title):
        paths.pop("png")
    return paths

