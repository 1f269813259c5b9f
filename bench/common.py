"""What every benchmark shares: the GPU check, timing, ceilings, and the result files.

| helper             | what it measures or records                                           |
| ------------------ | --------------------------------------------------------------------- |
| `time_ms`          | GPU time of ``fn()``: `triton.testing.do_bench` median, L2 flushed     |
| `time_ms_graph`    | the same, for ``fn`` captured once in a CUDA graph and replayed: no    |
|                    | host launch cost; ``(None, reason)`` when capture fails                |
| `host_ms`          | host wall time of issuing ``fn()`` (synchronized before and after)     |
| `environment`      | device, versions, GPU clocks as found (``nvidia-smi``; None without)   |
| `tuning_picks`     | the tiles fusedpar's tuner picked so far (`write_results` adds them),  |
|                    | ``{"implementation": "torch"}`` where torch's won a key               |
| `implementation`   | what ran fusedpar's ops (``FUSEDPAR_IMPL``; `write_results` adds it)  |
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def require_gpu(family: str) -> bool:
    """True when a GPU with compiled kernels is available; otherwise say why (exit 0)."""
    if not torch.cuda.is_available():
        print(f"bench/{family}: no CUDA device here, nothing measured (benchmarks need a GPU)")
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(f"bench/{family}: TRITON_INTERPRET=1 would time the interpreter; unset it")
        return False
    return True


def quick() -> bool:
    """``BENCH_QUICK=1``: a smaller grid, for a GPU lease's 10-minute commands."""
    return os.environ.get("BENCH_QUICK") == "1"


def results_folder() -> Path:
    """bench/results/<device>/, or ``BENCH_RESULTS``/<device>/ when that is set (a GPU
    machine's copy of the repo is not this one: point it at a folder that comes back)."""
    root = Path(os.environ["BENCH_RESULTS"]) if os.environ.get("BENCH_RESULTS") else RESULTS
    return root / device_slug()


def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (triton.testing.do_bench: L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_ms_graph(fn, *, warmup: int = 25, rep: int = 100) -> tuple[float | None, str | None]:
    """``(median ms, None)`` of ``fn`` captured once in a CUDA graph and replayed under
    `time_ms`, or ``(None, reason)`` when it cannot be captured.

    ``fn()`` runs eagerly first, so fusedpar's tuner makes its picks (and Triton compiles)
    outside the capture: a pick timed during capture would fail it. Replaying under
    ``do_bench`` keeps everything but the launch path equal to `time_ms` (same L2 flush,
    same median), so ``time_ms(fn) - time_ms_graph(fn)`` is host launch overhead.
    `triton.testing.do_bench_cudagraph` instead replays many unflushed calls, which at
    the small shapes this is for (operands that fit the 50 MB L2) mixes a warm L2 into
    the difference.
    """
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as error:  # any capture failure is recorded with its reason, not raised
        torch.cuda.synchronize()
        return None, _reason(error)
    try:
        return time_ms(graph.replay, warmup=warmup, rep=rep), None
    finally:
        del graph  # its memory pool goes back before the next point


# What `time_ms_graph` measures, for the results' meta.
GRAPH_TIMING = "one call captured in a CUDA graph, replayed under do_bench (L2 flushed, median)"


def _reason(error: BaseException) -> str:
    """One line naming an exception, short enough for a table cell."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}"[:160]


def host_ms(fn, *, reps: int = 10) -> float:
    """Median host milliseconds of issuing ``fn()``: the device is synchronized before
    each call (an empty queue never blocks a launch) and after it (calls do not overlap);
    the timer stops when ``fn`` returns, before the GPU finishes."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        sync()
    return statistics.median(times)


def device_slug() -> str:
    """The results folder: the GPU's name, or "cpu-<cores>core" without one."""
    if not torch.cuda.is_available():
        return f"cpu-{os.cpu_count()}core"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def environment() -> dict:
    import triton

    import fusedpar

    env = {
        "device": (
            torch.cuda.get_device_name()
            if torch.cuda.is_available()
            else f"CPU ({os.cpu_count()} cores)"
        ),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "fusedpar": fusedpar.__version__,
        "python": sys.version.split()[0],
        "gpu_clocks": gpu_clocks(),
    }
    return env


CLOCK_QUERY = "clocks.sm,clocks.mem,clocks.max.sm"


def gpu_clocks() -> list[dict] | None:
    """The GPU clocks as found now, one dict per GPU ``nvidia-smi`` lists (keys as its CSV
    header says them, e.g. ``"clocks.current.sm [MHz]": "1980 MHz"``), or None when
    ``nvidia-smi`` is missing or fails. A clock below ``clocks.max.sm`` at the start of a
    run (idle, power or thermal limits) explains slow numbers; nothing here sets clocks."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, f"--query-gpu={CLOCK_QUERY}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return parse_csv_query(proc.stdout)


def parse_csv_query(text: str) -> list[dict] | None:
    """``nvidia-smi --format=csv`` output as one dict per data line (None if empty)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    header = [h.strip() for h in lines[0].split(",")]
    return [
        dict(zip(header, (v.strip() for v in line.split(",")), strict=False)) for line in lines[1:]
    ]


def tuning_picks() -> dict:
    """Every tile fusedpar's tuner picked in this process, ``{kernel: {key: config}}``."""
    from fusedpar.kernels.tuning import all_picks

    return all_picks()


def measured_ceilings() -> dict:
    """The roofs a result is read against, measured now on this device.

    - matmul: a large bf16 GEMM through torch (cuBLAS), TFLOP/s;
    - copy: a large device-to-device copy, GB/s (bytes read + bytes written).
    """
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul_ms = time_ms(lambda: a @ b)
    src = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    return {
        "matmul_bf16_tflops": 2 * n**3 / matmul_ms / 1e9,
        "copy_gbps": 2 * src.numel() / copy_ms / 1e6,
    }


def paired_bars(ax, labels, ours, theirs, ours_label, theirs_label, ylabel, title) -> None:
    """Two bars per point (ours left, the peer right): the plot of most benchmarks."""
    xs = range(len(labels))
    ax.bar([i - 0.2 for i in xs], ours, 0.4, label=ours_label)
    ax.bar([i + 0.2 for i in xs], theirs, 0.4, label=theirs_label)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()


def write_results(
    family: str, rows: list[dict], columns: list[str], meta: dict, plot=None, announce=True
):
    """Write <results folder>/<family>.{json,md,png}; return the folder.

    `plot`, if given, is ``plot(ax)`` drawing on a matplotlib axis. A missing value is
    None: null in the JSON, "n/a" in the table. The tuner's picks so far are added to the
    meta as ``tuning_picks`` (a section of their own in the table), and what ran
    fusedpar's ops as ``implementation``.
    """
    folder = results_folder()
    folder.mkdir(parents=True, exist_ok=True)
    import fusedpar as fp

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {
        **meta,
        "implementation": fp.implementation_summary(device_type),
        "tuning_picks": tuning_picks(),
    }
    text = json.dumps({"meta": meta, "rows": rows}, indent=2, allow_nan=False)
    (folder / f"{family}.json").write_text(text)

    def cell(v):
        if v is None:
            return "n/a"
        if not isinstance(v, float):
            return str(v)
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"  # 3 figures, never "1e+03"

    lines = [f"# {family} on {meta.get('device', '?')}", ""]
    lines += [f"- {k}: {cell(v)}" for k, v in meta.items() if k not in ("device", "tuning_picks")]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    lines += _picks_section(meta["tuning_picks"])
    (folder / f"{family}.md").write_text("\n".join(lines) + "\n")

    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        else:
            fig, ax = plt.subplots(figsize=(10, 5))
            plot(ax)
            fig.tight_layout()
            fig.savefig(folder / f"{family}.png", dpi=120)
            plt.close(fig)
    if announce:
        print(f"results in {folder}/{family}.*")
    return folder


def _picks_section(picks: dict) -> list[str]:
    """The tuner's picks as markdown lines, one per (kernel, key)."""
    if not any(picks.values()):
        return []
    lines = ["", "## Tuner picks", ""]
    for kernel, by_key in picks.items():
        for key, config in by_key.items():
            if "implementation" in config:  # torch's implementation won this key
                lines.append(f"- {kernel} {key}: {config['implementation']}")
                continue
            tile = " ".join(f"{k}={v}" for k, v in config["kwargs"].items())
            lines.append(
                f"- {kernel} {key}: {tile}, {config['num_warps']} warps, "
                f"{config['num_stages']} stages"
            )
    return lines
