"""Train the tiny Llama with TP x CP (x EP for the MoE variant) next to its reference.

    torchrun --nproc-per-node 4 examples/train.py --tp 2 --cp 2 [--moe]
    torchrun --nproc-per-node 4 examples/train.py --tp 1 --cp 2 --ulysses 2
    torchrun --nproc-per-node 4 examples/train.py --pp 2 --tp 2 [--schedule DualPipeV --layers 4]
    torchrun --nproc-per-node 4 examples/train.py --steps 10 --save ckpt --save-every 5
    torchrun --nproc-per-node 4 examples/train.py --steps 15 --tp 2 --cp 2 --resume ckpt

GPUs: NCCL, and per shape the faster of fusedpar's Triton kernels and torch's (timed
once). CPU: gloo and torch's ops, or with FUSEDPAR_IMPL=triton fusedpar's kernels in
Triton's interpreter (a debugging tool: minutes, not seconds). Every
parameter is a DTensor on the (dp, cp[, ulysses], tp) mesh (`fp.distribute`); data
parallelism over the remaining ranks (dp = world / (pp * tp * cp * ulysses)) goes through
PyTorch's FSDP2 on the "dp" axis of that mesh. With `--pp` the mesh is (pp, dp, cp, tp):
`fp.pipeline.split` cuts the model into the stages of a torch.distributed.pipelining
schedule, and each rank's stages live on its stage's sub-mesh. Checkpoints (`--save`)
hold the model and AdamW state through `torch.distributed.checkpoint`, are complete or
invisible (a run killed while saving leaves the last complete one), and resume at any
layout (`--resume`). The text is this repository's own docs, read as bytes (nothing is
fetched). `--batch` is the global batch, split over the dp ranks: step N's sequences are
drawn from (--seed, N, --batch) alone, so a run resumed at another dp degree trains on
the batches the uninterrupted run would have. Rank 0 trains the single-device reference
on the same batches and ends with how far the two loss curves are apart.

`main` makes the process group (torchrun's environment), or runs in one already made
(a `fusedpar.testing.World`'s, in the tests) and leaves it.
"""

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Both curves are fp32 with the same batches: they agree to rounding, and AdamW's
# normalized steps let that rounding grow slowly. Measured on CPU: about 1e-6 relative.
PARITY_TOLERANCE = 1e-3  # relative


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    parser.add_argument(
        "--schedule",
        default="1F1B",
        help="with --pp: 1F1B, GPipe, "
        "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or "
        "DualPipeV (the last five: two stages per pipeline rank)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="N",
        help="with --pp: per step (default: one per stage)",
    )
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument(
        "--ulysses", type=int, default=1, help="Ulysses degree (with --cp > 1: the hybrid)"
    )
    parser.add_argument("--moe", action="store_true", help="MoE MLPs, experts over --ep")
    parser.add_argument(
        "--ep",
        default="tp",
        metavar="AXES",
        help="with --moe: the axes the experts split over, in mesh order (tp; dp; dp,tp; cp,tp)",
    )
    parser.add_argument(
        "--ep-degree",
        type=int,
        default=None,
        metavar="N",
        help="with --ep naming dp: the EP degree, below the axes' product (part of dp)",
    )
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--batch",
        type=int,
        default=4,
        help="sequences per step (the global batch), split over the data-parallel ranks",
    )
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="DIR", help="write checkpoints to DIR/step-N")
    parser.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="with --save: every N steps as well as at the end",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="with --save: replace checkpoints already in DIR"
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="with --save: write checkpoints while training goes on",
    )
    parser.add_argument(
        "--resume",
        metavar="CKPT",
        help="continue from DIR/step-N, or from "
        "DIR's latest complete step-N, at any tp/cp/dp layout; --steps counts "
        "from the start",
    )
    return parser.parse_args(argv)


def configure(args, world: int):
    """(the model's Config, the ParallelDims, microbatches or None) of `args` on `world`
    ranks, or ValueError naming what does not fit. No communication: every rank fails
    the same way, at once."""
    from tiny_llama import Config

    import fusedpar as fp

    cfg = Config(
        d_model=args.d_model,
        d_hidden=2 * args.d_model,
        n_layers=args.layers,
        num_experts=args.experts if args.moe else 0,
    )
    others = args.pp * args.tp * args.cp * args.ulysses
    dims = fp.ParallelDims(
        dp=max(1, world // others),
        cp=args.cp,
        tp=args.tp,
        pp=args.pp,
        ulysses=args.ulysses,
        ep=tuple(args.ep.split(",")) if args.moe else None,
        ep_degree=args.ep_degree if args.moe else None,
    )
    dims.validate(
        world,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        num_experts=cfg.num_experts or None,
        seq_len=args.seq,
        n_layers=args.layers,
        microbatches=args.microbatches,
        schedule=args.schedule,
    )
    if args.batch < 1 or args.batch % dims.dp:
        raise ValueError(
            f"--batch {args.batch} (the global batch) does not split over the "
            f"{dims.dp} data-parallel ranks: give a multiple of {dims.dp}"
        )
    microbatches = None
    if args.pp > 1:
        microbatches = args.microbatches or fp.pipeline.stage_count(args.schedule, args.pp)
        if (args.batch // dims.dp) % microbatches:
            raise ValueError(
                f"--batch {args.batch} over {dims.dp} data-parallel ranks is "
                f"{args.batch // dims.dp} sequences a rank, which do not split "
                f"into {microbatches} microbatches"
            )
    return cfg, dims, microbatches


def load_corpus():
    import torch

    root = HERE.parent
    text = b"\n\n".join(
        p.read_bytes() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Progress:
    """One line that redraws itself on a terminal (a line per few steps otherwise)."""

    def __init__(self, total: int):
        self.total, self.tty = total, sys.stdout.isatty()

    def update(self, step: int, text: str) -> None:
        done = int(24 * step / self.total)
        line = f"[{'#' * done}{'.' * (24 - done)}] {step}/{self.total} {text}"
        if self.tty:
            print("\r" + line, end="" if step < self.total else "\n", flush=True)
        elif step % 5 == 0 or step == self.total:
            print(line, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if torch.cuda.is_available() and not cuda and os.environ.get("LOCAL_RANK") == "0":
        print(
            f"{torch.cuda.device_count()} GPU(s) for {local_ranks} local ranks: running on "
            "the CPU (gloo) instead",
            flush=True,
        )
    if not cuda and os.environ.get("FUSEDPAR_IMPL") == "triton":
        # before anything imports triton: on a CPU the kernels run in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist

    owned = not dist.is_initialized()  # torchrun's ranks: ours to make and to end
    if not owned:  # a group made before (a World's, in the tests): its backend decides
        cuda = dist.get_backend() == "nccl"
    else:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # torchrun's contract
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return train(args, cuda)
    finally:
        if owned:
            dist.destroy_process_group()


def train(args, cuda: bool) -> int:
    """The demo on the default process group: 0 at parity, 1 if not, 2 if refused."""
    import torch
    import torch.distributed as dist
    from tiny_llama import ParallelTransformer, Transformer

    import fusedpar as fp

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        cfg, dims, microbatches = configure(args, world)
    except ValueError as e:
        print(f"rank {rank}: bad configuration: {e}", file=sys.stderr, flush=True)
        return 2
    mesh = dims.build_mesh("cuda" if cuda else "cpu")
    groups = dims.groups(mesh)
    device = torch.device("cuda") if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    reference = Transformer(cfg).to(device)
    model = ParallelTransformer(reference, groups).to(device)
    pipe = None
    if args.pp > 1:  # this rank's stages: their parameters on the stage's sub-mesh
        pipe = fp.pipeline.split(
            model, dims, mesh, schedule=args.schedule, microbatches=microbatches, loss_fn=model.loss
        )
        model = fp.distribute(pipe.model, dims.stage_mesh(mesh))
        for part in pipe.stage_modules if dims.dp > 1 else ():
            dims.fully_shard(part, dims.stage_mesh(mesh))  # FSDP2 over "dp", per stage
    else:
        fp.distribute(model, mesh)  # every parameter a DTensor on the full mesh
        if dims.dp > 1:  # (at dp 1 nothing to shard: fully_shard would skip it anyway)
            dims.fully_shard(model, mesh)  # FSDP2 over "dp"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    first_step = 1
    if args.resume:  # a directory of checkpoints: its newest complete one
        resume = fp.checkpoint.latest(args.resume) or args.resume
        try:  # complete, and the shapes, checked on every rank before anything is read
            first_step = fp.checkpoint.load(resume, model, optimizer)["step"] + 1
        except ValueError as e:
            print(f"rank {rank}: cannot resume: {e}", file=sys.stderr, flush=True)
            return 2
        if rank == 0:
            print(f"resuming from {resume} (step {first_step - 1})", flush=True)
            where = Path(fp.checkpoint.resolve(resume))  # (an overwrite's old copy, if cut)
            saved = torch.load(where / "reference.pt", map_location=device)
            reference.load_state_dict(saved["model"])
            ref_optimizer.load_state_dict(saved["optimizer"])

    pending = None  # the asynchronous save in flight

    def save(step: int) -> None:
        nonlocal pending
        reference_state = {"model": reference.state_dict(), "optimizer": ref_optimizer.state_dict()}
        pending = fp.checkpoint.save(
            Path(args.save) / f"step-{step}",
            model,
            optimizer,
            extra={"step": step},
            overwrite=args.overwrite,
            files={"reference.pt": reference_state} if rank == 0 else None,
            async_save=args.async_save,
        )

    corpus = load_corpus()
    dp_rank, local = mesh["dp"].get_local_rank(), args.batch // dims.dp
    tokens_per_step = args.batch * args.seq
    if rank == 0:
        ulysses = f" x ulysses {dims.ulysses}" if dims.ulysses > 1 else ""
        pp = f"pp {dims.pp} x " if pipe else ""
        per_stage = args.layers // pipe.num_stages if pipe else 0
        schedule = (
            (
                f" ({args.schedule}: {pipe.num_stages} stages of {per_stage} layers, "
                f"{pipe.microbatches} microbatches)"
            )
            if pipe
            else ""
        )
        experts = f" (MoE, EP {dims.ep_size} over {' x '.join(dims.ep_axes)})" if args.moe else ""
        print(
            f"fusedpar demo: {world} ranks = {pp}dp {dims.dp} x cp {dims.cp}{ulysses} x tp "
            f"{dims.tp}{schedule}{experts}, "
            f"{'NCCL' if cuda else 'gloo'}, "
            f"{fp.implementation_summary(device.type)}, {tokens_per_step} tokens per step",
            flush=True,
        )
    progress, losses, ref_losses = Progress(args.steps), [], []
    start = time.perf_counter()
    for step in range(first_step, args.steps + 1):
        # the step's global batch, a function of (seed, step, batch) alone: the same at any
        # layout, so a run resumed at another dp degree goes on with the same batches
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(0, corpus.numel() - args.seq - 1, (args.batch,), generator=gen)
        windows = torch.stack([corpus[s : s + args.seq + 1] for s in starts.tolist()]).to(device)
        mine = windows[dp_rank * local : (dp_rank + 1) * local]  # this dp rank's share
        if pipe:  # the last stage's ranks get the microbatches' losses, the others none
            losses_mb = pipe.step(mine[:, :-1], target=mine[:, 1:])
            total = fp.pipeline.stage_losses_total(losses_mb, device=device)
        else:
            loss = model(mine[:, :-1], mine[:, 1:])
            loss.backward()
            total = loss.detach().clone()
        optimizer.step()
        optimizer.zero_grad()
        if args.moe:  # the step's loads over the stage's ranks: one all-reduce, all layers
            fp.nn.moe.update_expert_bias(model, dims.stage_mesh(mesh))
        dist.all_reduce(total)  # sum of the shares of every (dp, cp, tp) rank ...
        losses.append(total.item() / dims.dp)  # ... averaged over the dp batches
        if rank == 0:
            ref_loss = reference(windows[:, :-1], windows[:, 1:])
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            ref_losses.append(ref_loss.item())
            rate = len(losses) * tokens_per_step / (time.perf_counter() - start)
            balance = ""
            if args.moe:  # the worst MoE layer's max/mean tokens per expert (this stage's)
                stats = fp.nn.moe.load_stats(model).values()
                worst = max((s.max_over_mean.item() for s in stats), default=1.0)
                balance = f", experts' load max/mean {worst:.2f}"
            progress.update(
                step,
                f"loss {losses[-1]:.4f} (reference {ref_losses[-1]:.4f}) {rate:,.0f} tokens/s"
                f"{balance}",
            )
        if args.save and (step == args.steps or args.save_every and step % args.save_every == 0):
            try:
                save(step)
            except FileExistsError as e:  # on every rank, before anything is written
                print(
                    f"rank {rank}: cannot save: {e} (--overwrite does)", file=sys.stderr, flush=True
                )
                return 2
    if pending is not None:
        pending.wait()  # the last checkpoint complete before the group goes
    ok = True
    if rank == 0 and losses:
        if args.save or args.resume:  # every digit, to compare a resumed run with its original
            print(f"losses from step {first_step}: {' '.join(map(repr, losses))}", flush=True)
        gaps = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        relative = gaps[worst] / abs(ref_losses[worst])
        ok = relative <= PARITY_TOLERANCE
        print(
            f"parity: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
            f"max |loss - reference| = {gaps[worst]:.2e} at step {first_step + worst} "
            f"({relative:.1e} relative, tolerance {PARITY_TOLERANCE:.0e}): "
            f"{'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
