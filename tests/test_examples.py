"""End to end at 4 ranks: the 2-layer fusedpar model (TP2 x CP2, EP2 for MoE) trains
like the single-device reference: the same loss and every parameter gradient (gathered
to full shapes), within the tolerance rule; a few SGD steps keep the losses together;
bad configurations fail at start, on every rank, naming the degree."""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fusedpar as fp
from fusedpar.testing import WorldError, assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_llama import Config, ParallelTransformer, Transformer  # noqa: E402

SEQ, BATCH = 16, 2


def _config(moe: bool) -> Config:
    return Config(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_hidden=64,
                  num_experts=4 if moe else 0, top_k=2)  # fmt: skip


def _build(moe: bool, seed: int):
    dims = fp.ParallelDims(cp=2, tp=2, ep="tp" if moe else None)
    cfg = _config(moe)
    dims.validate(dist.get_world_size(), n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                  num_experts=cfg.num_experts or None, seq_len=SEQ)  # fmt: skip
    groups = dims.groups(dims.build_mesh("cpu"))
    torch.manual_seed(seed)
    reference = Transformer(cfg)
    reference64 = Transformer(cfg).double()
    reference64.load_state_dict(reference.state_dict())
    return cfg, groups, reference, reference64, ParallelTransformer(reference, groups, dims.ep_axes)


def _batch(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _full_grad(name, grad, groups, moe):
    """A parallel parameter's gradient gathered to the reference parameter's shape."""
    split = {"q_weight": 0, "k_weight": 0, "v_weight": 0, "o_weight": 1,
             "gate_weight": 0, "up_weight": 0, "down_weight": 1}  # fmt: skip
    leaf = name.rsplit(".", 1)[-1]
    if leaf in split:
        return fp.comm.gather_from_region(grad, groups["tp"], dim=split[leaf])
    if moe and leaf in ("w1", "w2", "w3"):
        return fp.comm.gather_from_region(grad, groups["ep"], dim=0)
    return grad


def _reference_name(name: str) -> str:
    pairs = [(f".attn.{p}_weight", f".attn.{p}.weight") for p in "qkvo"]
    pairs += [(f".mlp.{p}_weight", f".mlp.{p}.weight") for p in ("gate", "up", "down")]
    pairs.append((".mlp.router_weight", ".mlp.router"))
    for ours, theirs in pairs:
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


def _total_loss(loss):
    total = loss.detach().clone()
    dist.all_reduce(total)  # the TP x CP group is the whole world here (dp = 1)
    return total


def _run_one_step(moe, seed):
    cfg, groups, reference, reference64, model = _build(moe, seed)
    inputs, labels = _batch(cfg, seed + 1)
    ref_loss = reference(inputs, labels)
    ref_loss.backward()
    ref64_loss = reference64(inputs, labels)
    ref64_loss.backward()
    loss = model(inputs, labels)
    loss.backward()
    model.finalize_grads()
    assert_close(_total_loss(loss).reshape(1), ref64_loss.detach().reshape(1),
                 ref_loss.detach().reshape(1), name="loss")  # fmt: skip
    ref_params = dict(reference.named_parameters())
    ref64_params = dict(reference64.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        full = _full_grad(name, param.grad, groups, moe)
        theirs = _reference_name(name)
        assert_close(full, ref64_params[theirs].grad, ref_params[theirs].grad, name=name)
        checked += 1
    assert checked == len(ref_params)
    return True


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_one_step_matches_the_reference(world, moe):
    assert all(world(4).run(_run_one_step, moe, 0))


def _run_steps(moe, seed, steps):
    cfg, _, reference, reference64, model = _build(moe, seed)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, reference64, model)]
    for step in range(steps):
        inputs, labels = _batch(cfg, seed + 100 + step)
        losses = []
        for m, opt in zip((reference, reference64, model), optimizers, strict=True):
            opt.zero_grad()
            loss = m(inputs, labels)
            loss.backward()
            if m is model:
                m.finalize_grads()
                loss = _total_loss(loss)
            opt.step()
            losses.append(loss.detach().reshape(1))
        assert_close(losses[2], losses[1], losses[0], name=f"loss at step {step}")
    return True


def test_a_few_sgd_steps_keep_the_losses_together(world):
    assert all(world(4).run(_run_steps, True, 3, 3))


def _run_bad_config(kwargs, check):
    dims = fp.ParallelDims(**kwargs)
    dims.validate(dist.get_world_size(), **check)


@pytest.mark.parametrize(
    "kwargs, check, match",
    [({"cp": 2, "tp": 1}, {}, r"dp \(1\) x cp \(2\) x tp \(1\) = 2.*4 ranks"),
     ({"cp": 2, "tp": 2}, {"n_heads": 5}, r"n_heads \(5\).*tp degree \(2\)"),
     ({"cp": 2, "tp": 2}, {"seq_len": 18}, r"seq_len \(18\).*cp\s+degree 2"),
     ({"cp": 2, "tp": 2, "ep": ("cp", "tp")}, {"num_experts": 6},
      r"num_experts \(6\).*ep degree \(4"),
     ({"dp": 4, "ep": "pp"}, {}, "ep runs over"),
     ({"dp": 2, "tp": 2, "ep": "dp"}, {}, r"ep over dp \(dp degree 2\)")],
)  # fmt: skip
def test_bad_configurations_fail_on_every_rank(world, kwargs, check, match):
    with pytest.raises(WorldError) as info:
        world(4).run(_run_bad_config, kwargs, check)
    assert sorted(info.value.exceptions) == [0, 1, 2, 3]
    for e in info.value.exceptions.values():
        assert isinstance(e, ValueError) and re.search(match, str(e)), repr(e)


def _torchrun(*args, timeout=600):
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(root / "examples" / "train.py"), *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier stays on CPU (gloo) on a GPU machine too
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_demo_script_trains_and_reports_parity():
    proc = _torchrun("--tp", "2", "--cp", "2", "--moe", "--steps", "2", "--seq", "16",
                     "--batch", "2", "--d-model", "32")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"parity: .* over 2 steps; .*: OK", proc.stdout), proc.stdout


def test_the_demo_script_rejects_bad_degrees_on_every_rank():
    proc = _torchrun("--tp", "3", "--cp", "2", "--steps", "1")
    assert proc.returncode != 0
    assert (
        len(re.findall(r"bad configuration: dp \(1\) x cp \(2\) x tp \(3\) = 6", proc.stderr)) == 4
    )


def _run_ep_over_a_pair():
    dims = fp.ParallelDims(cp=2, tp=2, ep=("cp", "tp"))
    groups = dims.groups(dims.build_mesh("cpu"))
    torch.manual_seed(0)
    moe = fp.nn.MoE(8, 6, 8, 2, groups["ep"])
    y, _ = moe(torch.randn(5, 8))
    return fp.comm.group_size(groups["ep"]), tuple(moe.w1.shape), tuple(y.shape)


def test_ep_over_a_flattened_pair_of_axes(world):
    assert world(4).run(_run_ep_over_a_pair) == [(4, (2, 6, 8), (5, 8))] * 4
