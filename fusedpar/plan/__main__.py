"""python -m fusedpar.plan: rank every layout of a model on N GPUs.

    python -m fusedpar.plan llama3-70b --gpus 256 --seq-len 8192 --global-batch-tokens 4M
    python -m fusedpar.plan path/to/config.json --gpus 64 --device h200 --out plans/
    python -m fusedpar.plan deepseek-v3 --gpus 1024 --seq-len 4096 --layout dp=16,cp=8,tp=8,ep=cp+tp

Prints the ranked table (markdown); ``--out DIR`` also writes plan.md, plan.json and
plan.png there. ``--layout`` estimates one layout instead of searching.
"""

import argparse
import json
import sys

import torch

from fusedpar.parallel import ParallelDims
from fusedpar.plan import report
from fusedpar.plan.accounting import POLICIES
from fusedpar.plan.devices import DEVICES, device
from fusedpar.plan.estimate import DP_SHARDING, estimate
from fusedpar.plan.model import PRESETS, model_spec
from fusedpar.plan.search import search

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tokens(text: str) -> int:
    """"4M", "512K", "1048576" -> an int (K and M: powers of two)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def layout(text: str) -> ParallelDims:
    """"dp=16,tp=8,ep=cp+tp" -> ParallelDims."""
    kwargs = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name == "ep":
            axes = tuple(value.split("+"))
            kwargs["ep"] = axes[0] if len(axes) == 1 else axes
        else:
            kwargs[name] = int(value)
    return ParallelDims(**kwargs)


def text_of(dims: ParallelDims) -> str:
    """ParallelDims(dp=16, tp=8) -> "dp=16,tp=8"."""
    axes = ("pp", "dp", "cp", "ulysses", "tp")
    return ",".join(f"{a}={getattr(dims, a)}" for a in axes if getattr(dims, a) > 1) or "dp=1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fusedpar.plan", description=__doc__.split("\n")[0])
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch-tokens", type=tokens, default=tokens("4M"),
                   help="tokens a step, e.g. 4M (default)")  # fmt: skip
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    for name in ("peak-tflops", "memory-gb", "hbm-tbps", "nvlink-gbps", "network-gbps"):
        p.add_argument(f"--{name}", type=float, help="override the device's")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--checkpointing", choices=POLICIES, help="default: the cheapest that fits")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="AdamW: fp32 master weights and two moments")
    p.add_argument("--cp-ring", choices=("auto", "latent", "expanded"), default="auto",
                   help="MLA's ring (auto: the latent where it moves less, as on a GPU)")
    p.add_argument("--document-len", type=int,
                   help="packed documents of this many tokens (default: one per sequence)")
    p.add_argument("--dp-sharding", choices=DP_SHARDING,
                   help="FSDP2's resharding (default: zero3 with --layout; a search tries "
                        "zero3 and zero1)")  # fmt: skip
    p.add_argument("--layout", type=layout, help="estimate this layout only: dp=8,tp=8,...")
    p.add_argument("--micro-batch", type=int, default=1, help="with --layout")
    p.add_argument("--schedule", help="with --layout and pp > 1")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", help="write plan.md, plan.json, plan.png here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = model_spec(args.model)
    dev = device(args.device, peak_tflops=args.peak_tflops, memory_gb=args.memory_gb,
                 hbm_tbps=args.hbm_tbps, nvlink_gbps=args.nvlink_gbps,
                 network_gbps=args.network_gbps)  # fmt: skip
    common = dict(device=dev, dtype=DTYPES[args.dtype], gpus_per_node=args.gpus_per_node,
                  optimizer=args.optimizer, document_len=args.document_len,
                  cp_ring=args.cp_ring)
    title = (f"{spec.name} on {args.gpus} x {dev.name}, sequences of {args.seq_len}, "
             f"{args.global_batch_tokens:,} tokens a step")  # fmt: skip
    if args.layout is not None:
        dims = args.layout
        sequences = args.global_batch_tokens // args.seq_len
        microbatches = sequences // dims.dp // args.micro_batch
        try:
            ranks = dims.pp * dims.dp * dims.cp * dims.ulysses * dims.tp
            if ranks != args.gpus:
                raise ValueError(f"--layout {text_of(dims)} has {ranks} ranks, --gpus {args.gpus}")
            est = estimate(spec, dims, seq_len=args.seq_len, micro_batch=args.micro_batch,
                           microbatches=microbatches, schedule=args.schedule,
                           checkpointing=args.checkpointing or "none",
                           dp_sharding=args.dp_sharding or "zero3", **common)  # fmt: skip
        except ValueError as e:
            print(f"python -m fusedpar.plan: {e}", file=sys.stderr)
            return 2
        print(json.dumps(est.as_dict(), indent=1, default=str))
        return 0 if est.fits else 1
    shardings = {"dp_shardings": (args.dp_sharding,)} if args.dp_sharding else {}
    result = search(spec, gpus=args.gpus, seq_len=args.seq_len,
                    global_batch_tokens=args.global_batch_tokens,
                    checkpointing=args.checkpointing, **common, **shardings)  # fmt: skip
    if args.out:
        paths = report.write(result, args.out, title=title, gpus_per_node=args.gpus_per_node,
                             top=args.top)  # fmt: skip
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    print(report.markdown(result, top=args.top, title=title, gpus_per_node=args.gpus_per_node))
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
