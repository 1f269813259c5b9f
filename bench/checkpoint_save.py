"""What a checkpoint save costs the training loop: `fp.checkpoint.save` blocking against
``async_save=True``, on CPU ranks (gloo), for the demo model at TP 2 with its AdamW state.

Per size, the same state saved ``REPS`` times each way into a fresh directory under the
system's temporary directory; times are the slowest rank's, medians over the reps:

| column            | what                                                              |
| ----------------- | ----------------------------------------------------------------- |
| state_mib         | the bytes this rank writes (its shards of parameters and moments) |
| blocking_ms       | ``save(...)`` returning: the whole save, off nothing               |
| async_blocked_ms  | ``save(..., async_save=True)`` returning: staging into host memory |
|                   | and the agreement on the save's id; the training loop's cost       |
| async_total_ms    | from the call until ``wait()`` returns: written and committed     |
| off_path_ms       | async_total_ms - async_blocked_ms: what left the critical path     |
| step_ms           | a training step (forward, backward, AdamW) with no save running   |
| step_during_ms    | a step while the asynchronous save is written (median of those    |
|                   | run before it is done): what the background threads cost a step  |

The background threads share the host's cores (and Python's interpreter lock) with
training, so on a CPU rank a step slows while they write; on a GPU most of the step is
the GPU's. Run ``python -m bench checkpoint_save`` on any machine; the results go to
``bench/results/cpu-<cores>core/``.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

WORLD = 2
SIZES = {"1 layer": 1, "4 layers": 4}  # label: transformer blocks of d_model = D_MODEL
D_MODEL = 512
REPS = 3


def _model(layers: int):
    """The demo model at TP 2 (every parameter a DTensor), one AdamW step taken (its
    moments exist), and a step function on fixed data."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from tiny_llama import Config, ParallelTransformer, Transformer

    import fusedpar as fp

    dims = fp.ParallelDims(tp=WORLD)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    cfg = Config(
        vocab=64, d_model=D_MODEL, n_layers=layers, n_heads=8, n_kv_heads=8, d_hidden=2 * D_MODEL
    )
    model = fp.distribute(ParallelTransformer(Transformer(cfg), dims.groups(mesh)), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 64, (2, 65), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        model(data[:, :-1], data[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        return (time.perf_counter() - start) * 1e3

    step()
    return model, optimizer, step


def _any_rank(flag: bool) -> bool:
    import torch.distributed as dist

    flag = torch.tensor(int(flag))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def _rank(layers: int, root: str, reps: int) -> dict:
    """This rank's times for one size (see the module's table)."""
    import torch.distributed as dist

    import fusedpar as fp

    model, optimizer, step = _model(layers)
    state_bytes = sum(t.to_local().numel() * t.element_size() for t in model.parameters())
    state_bytes += sum(
        v.to_local().numel() * v.element_size()
        for s in optimizer.state.values()
        for k, v in s.items()
        if k != "step"
    )
    steps = [step() for _ in range(3)]
    blocking, blocked, total, during = [], [], [], []
    for rep in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fp.checkpoint.save(Path(root) / f"blocking-{layers}-{rep}", model, optimizer)
        blocking.append((time.perf_counter() - start) * 1e3)
        dist.barrier()
        start = time.perf_counter()
        pending = fp.checkpoint.save(
            Path(root) / f"async-{layers}-{rep}", model, optimizer, async_save=True
        )
        blocked.append((time.perf_counter() - start) * 1e3)
        while _any_rank(not pending.done()):  # training goes on (every rank in step)
            during.append(step())
        pending.wait()
        total.append((time.perf_counter() - start) * 1e3)
    return {
        "state_mib": state_bytes / 2**20,
        "blocking_ms": statistics.median(blocking),
        "async_blocked_ms": statistics.median(blocked),
        "async_total_ms": statistics.median(total),
        "step_ms": statistics.median(steps),
        "step_during_ms": statistics.median(during) if during else None,
        "steps_during": len(during) / reps,
    }


def measure(sizes=None, reps: int = REPS) -> list[dict]:
    """One row per size: the slowest rank's times."""
    from fusedpar.testing import World

    rows = []
    root = tempfile.mkdtemp(prefix="fusedpar-bench-checkpoint-")
    try:
        with World(WORLD) as pool:
            for label, layers in (sizes or SIZES).items():
                per_rank = pool.run(_rank, layers, root, reps)
                row = {"size": label, **per_rank[0]}
                for key in (
                    "blocking_ms",
                    "async_blocked_ms",
                    "async_total_ms",
                    "step_ms",
                    "step_during_ms",
                ):
                    values = [r[key] for r in per_rank if r[key] is not None]
                    row[key] = max(values) if values else None
                row["off_path_ms"] = row["async_total_ms"] - row["async_blocked_ms"]
                rows.append(row)
                print(
                    f"{label} ({row['state_mib']:.0f} MiB a rank): blocking "
                    f"{row['blocking_ms']:.0f} ms; async {row['async_blocked_ms']:.0f} ms "
                    f"blocked, {row['async_total_ms']:.0f} ms to committed"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    from bench.common import environment, write_results

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())  # other work on the host, at start
    rows = measure()
    columns = [
        "size",
        "state_mib",
        "blocking_ms",
        "async_blocked_ms",
        "async_total_ms",
        "off_path_ms",
        "step_ms",
        "step_during_ms",
        "steps_during",
    ]

    def plot(ax):
        from bench.common import paired_bars

        paired_bars(
            ax,
            [f"{r['size']} ({r['state_mib']:.0f} MiB)" for r in rows],
            [r["async_blocked_ms"] for r in rows],
            [r["blocking_ms"] for r in rows],
            "async_save=True: save() returns",
            "blocking save",
            "ms (slowest rank)",
            f"checkpoint save on the training loop, {WORLD} CPU ranks",
        )

    meta = {
        **environment(),
        "device": f"CPU ({os.cpu_count()} cores), gloo",
        "world": WORLD,
        "d_model": D_MODEL,
        "reps": REPS,
        "storage": f"{tempfile.gettempdir()} (the system's temporary directory)",
        "load_average_at_start": load,
    }
    write_results("checkpoint_save", rows, columns, meta, plot)
