"""python -m bench [family ...]: run the benchmarks (all of them by default)."""

import importlib
import sys

FAMILIES = [
    "matmul",
    "attention",
    "linear_attention",
    "linear",
    "ring_attention",
    "context_parallel",
    "moe",
    "host_overhead",
    "step_time",
    "checkpoint_save",
]


def main(argv: list[str]) -> None:
    families = argv or FAMILIES
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {FAMILIES}")
    for family in families:
        importlib.import_module(f"bench.{family}").main()


if __name__ == "__main__":
    main(sys.argv[1:])
