"""The devices the planner knows, from their vendors' datasheets (dense 16-bit tensor
FLOP/s, no sparsity), and the efficiencies measured on them in `bench/results/`.

| device     | bf16 TFLOP/s | memory GB | HBM TB/s | NVLink GB/s (each way) | network GB/s |
| ---------- | ------------ | --------- | -------- | ---------------------- | ------------ |
| h100 (SXM) | 989          | 80        | 3.35     | 450                    | 50 (400 Gb/s)|
| h200       | 989          | 141       | 4.8      | 450                    | 50           |
| h800       | 989          | 80        | 3.35     | 200                    | 50           |
| a100 (SXM) | 312          | 80        | 2.04     | 300                    | 25 (200 Gb/s)|
| b200       | 2250         | 180       | 8.0      | 900                    | 50           |

The network column is one NIC per GPU (the DGX/HGX layout). Give your own with
`Device(...)` or the command line's --peak-tflops, --memory-gb, --hbm-tbps, --nvlink-gbps,
--network-gbps: each drives the model on every device, a measured one included. A bench
table's rate is a fraction of the peak of the GPU it ran on (`measured_peak_tflops`):
with another peak the planner keeps the fraction, so an overridden peak scales the
measured GEMM and attention rates as it scales the stated fractions of devices without
a table. No rate exceeds the peak, so no MFU exceeds 100% (`estimate` raises if one
would).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense bf16
    memory_gb: float
    hbm_tbps: float
    nvlink_gbps: float  # per GPU, each way
    network_gbps: float  # per GPU, each way
    results: str = ""  # its folder under bench/results, if the bench ran on it
    # the dense peak of the GPU that folder's tables were measured on (0: this peak):
    # their rates scale by peak_tflops / measured_peak_tflops
    measured_peak_tflops: float = 0.0
    # Without a bench table: the fraction of peak a large GEMM and attention reach
    # (H100, measured: 680-770 TFLOP/s GEMMs of Llama's shapes, 0.69-0.78 of 989;
    # causal attention fwd+bwd 280-400, 0.3-0.4: bench/results/nvidia-h100-80gb-hbm3).
    gemm_efficiency: float = 0.70
    attention_efficiency: float = 0.38

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


DEVICES = {
    "h100": Device("H100 SXM", 989, 80, 3.35, 450, 50, "nvidia-h100-80gb-hbm3", 989),
    "h200": Device("H200", 989, 141, 4.8, 450, 50),
    "h800": Device("H800", 989, 80, 3.35, 200, 50),
    "a100": Device("A100 SXM", 312, 80, 2.04, 300, 25),
    "b200": Device("B200", 2250, 180, 8.0, 900, 50),
}


OVERRIDES = ("peak_tflops", "memory_gb", "hbm_tbps", "nvlink_gbps", "network_gbps")


def device(spec, **overrides) -> Device:
    """A Device from a name in DEVICES or a Device, with fields overridden (None: kept)."""
    if isinstance(spec, str):
        if spec.lower() not in DEVICES:
            raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICES)} (or a Device)")
        spec = DEVICES[spec.lower()]
    given = {k: v for k, v in overrides.items() if v is not None}
    for name, value in given.items():
        if name in OVERRIDES and not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    return replace(spec, **given)


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@cache
def _table(folder: str, name: str) -> list:
    path = RESULTS / folder / f"{name}.json"
    if not folder or not path.exists():
        return []
    return json.loads(path.read_text()).get("rows", [])


def _nearest(rows, key, point):
    """The row whose `key(row)` is nearest `point` in log space."""
    best, distance = None, math.inf
    for row in rows:
        values = key(row)
        if values is None:
            continue
        gap = sum(math.log(max(v, 1) / max(p, 1)) ** 2 for v, p in zip(values, point, strict=True))
        if gap < distance:
            best, distance = row, gap
    return best


def _measured(dev: Device, tflops: float, what: str) -> float:
    """A bench table's rate on `dev`: scaled to its peak (the module doc's rule), never
    above it."""
    rate = tflops * dev.peak_tflops / (dev.measured_peak_tflops or dev.peak_tflops)
    if rate > dev.peak_tflops:
        raise ValueError(
            f"bench/results/{dev.results}: {what} measured {tflops:.0f} TFLOP/s, "
            f"above the {dev.measured_peak_tflops or dev.peak_tflops:g} TFLOP/s "
            "peak it was measured at: give the Device its measured_peak_tflops"
        )
    return rate


@cache
def gemm_tflops(dev: Device, m: int, n: int, k: int) -> tuple[float, str]:
    """(TFLOP/s, where from) of an (m, k) x (k, n) bf16 GEMM on `dev`: the nearest shape
    of its bench table (the faster of fusedpar and torch, as `auto` picks), scaled to
    its peak, or the stated fraction of peak."""
    row = _nearest(_table(dev.results, "matmul"), lambda r: (r["M"], r["N"], r["K"]), (m, n, k))
    if row is not None:
        rate = max(row["fusedpar_tflops"], row["torch_tflops"])
        return _measured(dev, rate, f"a ({row['M']}, {row['N']}, {row['K']}) GEMM"), "bench"
    return dev.peak_tflops * dev.gemm_efficiency, "fraction"


@cache
def attention_tflops(dev: Device, seq: int, head_dim: int, causal: bool) -> tuple[float, str]:
    """(TFLOP/s, where from) of attention's forward and backward together on `dev`."""

    def key(row):
        ok = row.get("pass_") == "fwd+bwd" and not row.get("mask") and row["causal"] == causal
        return (row["S"], row["D"]) if ok and row.get("fusedpar") else None

    row = _nearest(_table(dev.results, "attention"), key, (seq, head_dim))
    if row is not None:
        what = f"attention at S={row['S']}, D={row['D']}"
        return _measured(dev, float(row["fusedpar"]), what), "bench"
    return dev.peak_tflops * dev.attention_efficiency, "fraction"
