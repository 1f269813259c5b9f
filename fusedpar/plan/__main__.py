"""python -m fusedpar.plan: rank every layout of a model on N GPUs.

    python -m fusedpar.plan llama3-70b --gpus 256 --seq-len 8192 --global-batch-tokens 4M
    python -m fusedpar.plan path/to/config.json --gpus 64 --device h200 --out plans/
    python -m fusedpar.plan deepseek-v3 --gpus 1024 --seq-len 4096 --layout dp=16,cp=8,tp=8,ep=cp+tp
    python -m fusedpar.plan deepseek-v3 --gpus 1024 --layout dp=128,tp=8,ep=dp,ep_degree=64

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
from fusedpar.plan.estimate import AXES, DP_SHARDING, estimate
from fusedpar.plan.model import PRESETS, model_spec
from fusedpar.plan.search import search

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line: ``prog: error: what (--help for usage)``,
    exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def positive(text: str) -> int:
    """A count of at least 1 ("8" -> 8)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_float(text: str) -> float:
    """A size above 0 ("312" -> 312.0)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def tokens(text: str) -> int:
    """A token count: "4M", "512K", "1048576" -> an int (K and M: powers of two)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        value = 0
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (4M, 512K, 1048576)")
    return int(value)


def layout(text: str) -> ParallelDims:
    """A layout: "dp=16,tp=8,ep=cp+tp" or "pp=16,dp=128,ep=dp,ep_degree=64" ->
    ParallelDims (its checks, `ParallelDims.validate`'s, run with the model's sizes)."""
    kwargs = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name == "ep":
            axes = tuple(value.split("+"))
            kwargs["ep"] = axes[0] if len(axes) == 1 else axes
        elif name in (*AXES, "ep_degree") and value.isdigit() and int(value) > 0:
            kwargs[name] = int(value)
        else:
            raise argparse.ArgumentTypeError(
                f"{part!r} in {text!r}: each part is AXIS=DEGREE (AXIS one of "
                f"{', '.join(AXES)}; DEGREE a positive integer), ep=AXIS[+AXIS...] or "
                "ep_degree=DEGREE (an EP group over part of dp)"
            )
    dims = ParallelDims(**kwargs)
    bad = [a for a in dims.ep_axes if a not in AXES or a == "pp"]
    if bad:
        raise argparse.ArgumentTypeError(
            f"ep over {'+'.join(bad)}: fusedpar runs EP over dp, cp, ulysses and tp"
        )
    return dims


def text_of(dims: ParallelDims) -> str:
    """ParallelDims(dp=16, tp=8) -> "dp=16,tp=8" (and ep=..., ep_degree=...)."""
    axes = ("pp", "dp", "cp", "ulysses", "tp")
    parts = [f"{a}={getattr(dims, a)}" for a in axes if getattr(dims, a) > 1] or ["dp=1"]
    if dims.ep_axes:
        parts.append(f"ep={'+'.join(dims.ep_axes)}")
    if dims.ep_degree is not None:
        parts.append(f"ep_degree={dims.ep_degree}")
    return ",".join(parts)


FLAGS = ("peak-tflops", "memory-gb", "hbm-tbps", "nvlink-gbps", "network-gbps")


def parser() -> Parser:
    p = Parser(prog="python -m fusedpar.plan", description=__doc__.split("\n")[0])
    p.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    p.add_argument("--gpus", type=positive, required=True)
    p.add_argument("--gpus-per-node", type=positive, default=8)
    p.add_argument("--seq-len", type=positive, default=8192)
    p.add_argument(
        "--global-batch-tokens",
        type=tokens,
        default=tokens("4M"),
        help="tokens a step, e.g. 4M (default)",
    )
    p.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    for name in FLAGS:
        p.add_argument(f"--{name}", type=positive_float, help="override the device's")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--checkpointing", choices=POLICIES, help="default: the cheapest that fits")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="AdamW: fp32 master weights and two moments",
    )
    p.add_argument(
        "--cp-ring",
        choices=("auto", "latent", "expanded"),
        default="auto",
        help="MLA's ring (auto: the latent where it moves less, as on a GPU)",
    )
    p.add_argument(
        "--document-len",
        type=positive,
        help="packed documents of this many tokens (default: one per sequence)",
    )
    p.add_argument(
        "--dp-sharding",
        choices=DP_SHARDING,
        help="FSDP2's resharding (default: zero3 with --layout; a search tries zero3 and zero1)",
    )
    p.add_argument(
        "--layout",
        type=layout,
        help="estimate this layout only: dp=8,tp=8,... (ep=dp+tp, ep_degree=N: experts)",
    )
    p.add_argument("--micro-batch", type=positive, help="with --layout (default 1)")
    p.add_argument("--schedule", help="with --layout and pp > 1")
    p.add_argument("--top", type=positive, default=15)
    p.add_argument("--out", help="write plan.md, plan.json, plan.png here")
    return p


def parse_args(argv=None):
    return parser().parse_args(argv)


def main(argv=None) -> int:
    """The command line; a mistake in its arguments (an unknown device, model or layout,
    a batch that does not split) exits 2 with one line saying what."""
    p = parser()
    args = p.parse_args(argv)
    try:
        spec = model_spec(args.model)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if args.device.lower() not in DEVICES:
        flags = ", ".join(f"--{name}" for name in FLAGS)
        p.error(
            f"unknown --device {args.device!r}: give one of {', '.join(DEVICES)} (another "
            f"GPU: the nearest of them, its fields overridden by {flags})"
        )
    try:
        dev = device(
            args.device,
            **{name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name in FLAGS},
        )
    except ValueError as e:
        p.error(str(e))
    if args.layout is None and (args.micro_batch is not None or args.schedule is not None):
        p.error("--micro-batch and --schedule are for one --layout (a search tries them all)")
    if args.global_batch_tokens % args.seq_len:
        p.error(
            f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of "
            f"--seq-len {args.seq_len}"
        )
    common = dict(
        device=dev,
        dtype=DTYPES[args.dtype],
        gpus_per_node=args.gpus_per_node,
        optimizer=args.optimizer,
        document_len=args.document_len,
        cp_ring=args.cp_ring,
    )
    title = (
        f"{spec.name} on {args.gpus} x {dev.name}, sequences of {args.seq_len}, "
        f"{args.global_batch_tokens:,} tokens a step"
    )
    if args.layout is not None:
        dims, micro_batch = args.layout, args.micro_batch or 1
        sequences = args.global_batch_tokens // args.seq_len
        ranks = dims.pp * dims.dp * dims.cp * dims.ulysses * dims.tp
        if ranks != args.gpus:
            p.error(f"--layout {text_of(dims)} has {ranks} ranks, --gpus {args.gpus}")
        if sequences % (dims.dp * micro_batch):
            p.error(
                f"the {sequences} sequences a step (--global-batch-tokens / --seq-len) do "
                f"not split into dp ({dims.dp}) x --micro-batch ({micro_batch})"
            )
        try:
            est = estimate(
                spec,
                dims,
                seq_len=args.seq_len,
                micro_batch=micro_batch,
                microbatches=sequences // (dims.dp * micro_batch),
                schedule=args.schedule,
                checkpointing=args.checkpointing or "none",
                dp_sharding=args.dp_sharding or "zero3",
                **common,
            )
        except ValueError as e:
            p.error(f"--layout {text_of(dims)}: {e}")
        print(json.dumps(est.as_dict(), indent=1, default=str))
        return 0 if est.fits else 1
    shardings = {"dp_shardings": (args.dp_sharding,)} if args.dp_sharding else {}
    result = search(
        spec,
        gpus=args.gpus,
        seq_len=args.seq_len,
        global_batch_tokens=args.global_batch_tokens,
        checkpointing=args.checkpointing,
        **common,
        **shardings,
    )
    if args.out:
        paths = report.write(
            result, args.out, title=title, gpus_per_node=args.gpus_per_node, top=args.top
        )
        print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    print(report.markdown(result, top=args.top, title=title, gpus_per_node=args.gpus_per_node))
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
