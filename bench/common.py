"""What every benchmark shares: the GPU check, timing, ceilings, and the result files."""

import json
import os
import re
import sys
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


def device_slug() -> str:
    """The results folder: the GPU's name, or "cpu-<cores>core" without one."""
    if not torch.cuda.is_available():
        return f"cpu-{os.cpu_count()}core"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def environment() -> dict:
    import triton

    import fusedpar

    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "fusedpar": fusedpar.__version__,
        "python": sys.version.split()[0],
    }
    return env


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
    None: null in the JSON, "n/a" in the table.
    """
    folder = results_folder()
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "rows": rows}, indent=2, allow_nan=False)
    (folder / f"{family}.json").write_text(text)

    def cell(v):
        if v is None:
            return "n/a"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [f"# {family} on {meta.get('device', '?')}", ""]
    lines += [f"- {k}: {cell(v)}" for k, v in meta.items() if k != "device"]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
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
