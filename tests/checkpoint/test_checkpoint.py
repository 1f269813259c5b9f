"""Distributed checkpoints (`fp.checkpoint`) of the demo model on the full mesh: saved
at one layout (blocking, or asynchronously while training goes on), loaded at another,
every parameter and AdamW moment equals the gathered original bit for bit, and training
goes on with the uninterrupted run's losses; a checkpoint of another model, or an
interrupted save, fails on every rank, naming it, with nothing loaded. Then, in one
process: `latest`, overwriting, files saved beside the state, damage found. (Ranks
killed in the middle of saves: tests/checkpoint/test_checkpoint_kill.py.)
"""

import json
import os
import re
import shutil
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_llama import Config, ParallelTransformer, Transformer

import fusedpar as fp
from fusedpar.checkpoint_files import TIMEOUT_ENV, meet, tidy
from fusedpar.testing import exception_of
from tests.support import tiny

SEQ, BATCH, SAVED_AT = 16, 4, 2  # BATCH sequences per step, split over dp


def _config(moe: bool, d_model: int = 32, experts: int = 4, n_layers: int = 1) -> Config:
    # 4 heads (TP up to 4) of dimension 8: small, for Triton's interpreter
    return tiny.config(
        moe, d_model=d_model, n_layers=n_layers, n_kv_heads=4, d_hidden=32, experts=experts
    )


def _build(layout, moe=False, fsdp=True, **config):
    """The demo model at (dp, cp, tp) (experts over tp), on the full mesh, under FSDP2
    over dp (``fsdp``: True by this torch's own path, dp_mesh_dims from 2.12; False by
    the torch 2.11 path; None without), and its AdamW."""
    dp, cp, tp = layout
    dims = fp.ParallelDims(dp=dp, cp=cp, tp=tp, ep="tp" if moe else None)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = ParallelTransformer(Transformer(_config(moe, **config)), dims.groups(mesh))
    fp.distribute(model, mesh)
    if fsdp is not None:
        dims.fully_shard(model, mesh, dp_mesh_dims=None if fsdp else False)
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _train(mesh, model, optimizer, steps) -> list[float]:
    """AdamW steps on the same batches at any layout; the losses of the whole batch."""
    losses = []
    for step in steps:
        data = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = data.chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]
        loss = model(mine[:, :-1], mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / mesh["dp"].size())
    return losses


def _gathered(model, optimizer) -> dict:
    """Every parameter and optimizer state tensor, as full tensors."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor().clone()  # not a view: training goes on
        for key, value in optimizer.state[param].items():
            full = value.full_tensor() if key != "step" else value
            out[f"{name}.{key}"] = full.clone()
    return out


def _run_save(path, layout, moe, fsdp, steps_on, async_save):
    """Trained, saved, trained on (``async_save``: while the save is written, waited
    for after): the state saved, gathered, and the losses after it."""
    mesh, model, optimizer = _build(layout, moe, fsdp)
    _train(mesh, model, optimizer, range(SAVED_AT))
    pending = fp.checkpoint.save(
        path, model, optimizer, extra={"step": SAVED_AT}, async_save=async_save
    )
    gathered = _gathered(model, optimizer)
    losses = _train(mesh, model, optimizer, steps_on)  # changes the parameters in place
    if async_save:
        assert pending.wait() == path
    return gathered, losses


def _run_load(path, layout, moe, fsdp, steps_on):
    mesh, model, optimizer = _build(layout, moe, fsdp)
    extra = fp.checkpoint.load(path, model, optimizer)
    return extra, _gathered(model, optimizer), _train(mesh, model, optimizer, steps_on)


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, world, tmp_path_factory):
    """Trained SAVED_AT steps and saved at (dp=2, tp=2) (experts over tp: EP=2; MoE
    through FSDP2's torch 2.11 path), then trained on (dense, saved asynchronously: the
    steps run while it is written; the MoE checkpoint is checked bitwise only, a step
    costs seconds in the interpreter): (kind, path, tensors, steps trained on, their
    losses)."""
    moe = request.param == "moe"
    path = str(tmp_path_factory.mktemp(request.param) / "step-2")
    steps_on = [] if moe else [SAVED_AT, SAVED_AT + 1]
    gathered, losses = world(4).run(_run_save, path, (2, 1, 2), moe, not moe, steps_on, not moe)[0]
    return request.param, path, gathered, steps_on, losses


@pytest.mark.parametrize(
    "layout, fsdp",
    [((1, 1, 4), True), ((1, 2, 2), None), ((4, 1, 1), True), ((1, 1, 1), None), ((2, 1, 2), True)],
    ids=["dp1-tp4", "tp2-cp2-no-fsdp", "dp4-tp1", "one-rank", "the-same-layout"],
)
def test_loads_bitwise_at_another_layout(world, saved, layout, fsdp):
    kind, path, expected, steps_on, losses = saved
    if (
        kind == "moe"
        and layout in ((1, 2, 2), (1, 1, 1), (2, 1, 2))
        or kind == "dense"
        and layout == (4, 1, 1)
    ):
        pytest.skip("covered by the other model")
    world_size = layout[0] * layout[1] * layout[2]
    results = world(world_size).run(_run_load, path, layout, kind == "moe", fsdp, steps_on)
    extra, loaded, resumed = results[0]
    assert extra == {"step": SAVED_AT}
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    if layout == (2, 1, 2):  # where it was saved: training goes on bit for bit
        assert resumed == losses
    # the same parameters, another reduction order: rounding apart, grown by one AdamW step
    torch.testing.assert_close(resumed, losses, rtol=1e-5, atol=0)


WRONG = {
    "d_model": {"d_model": 64},
    "experts": {"experts": 8},
    "layers": {"n_layers": 0},
    "path on rank 3": {},
    "interrupted": {},
    "another save on rank 3": {},
}


def _run_load_wrong(path, what, other=None):
    """Load a checkpoint of another model (or, on one rank, a path that is not there, or
    `other`): the error, and whether anything changed."""
    mesh, model, optimizer = _build((1, 1, 4), moe=True, fsdp=None, **WRONG[what])
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    if what == "path on rank 3" and dist.get_rank() == 3:
        path += "-typo"
    if other is not None and dist.get_rank() == 3:
        path = other
    try:
        fp.checkpoint.load(path, model, optimizer)
    except ValueError as e:
        unchanged = all(
            torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters()
        )
        return str(e), unchanged and not optimizer.state
    return None, None


@pytest.mark.parametrize(
    "what, match",
    [
        ("d_model", r"model\.embed\.weight is \(64, 64\) in the model but \(64, 32\)"),
        ("experts", r"router_weight is \(8, 32\) in the model but \(4, 32\)"),
        ("layers", r"has model\.blocks\.0\..*, which the model does not \(\d+ such"),
        ("path on rank 3", r"cannot load \(rank 3\): FileNotFoundError: no checkpoint at .*-typo"),
        (
            "interrupted",
            r"cannot load \(rank 0\): ValueError: .* an interrupted save: it has no "
            r"complete\.json",
        ),
        (
            "another save on rank 3",
            r"cannot load .*: the ranks found different saves there \(rank "
            r"0: [0-9a-f]+, rank 3: 0bad\)",
        ),
    ],
)
def test_a_checkpoint_of_another_model_fails_on_every_rank(world, saved, what, match, tmp_path):
    """...before any rank reads it, and every rank: none is left waiting in DCP. An
    interrupted save: DCP's files without the record (as DCP itself, writing in place,
    or an older fusedpar left them)."""
    kind, path = saved[:2]
    if kind != "moe":
        pytest.skip("the MoE checkpoint has both")
    other = None
    if what == "interrupted":
        path = shutil.copytree(path, tmp_path / "step-2")
        (path / fp.checkpoint.RECORD).unlink()
    if what == "another save on rank 3":  # (a stale view of a shared directory, say)
        other = shutil.copytree(path, tmp_path / "step-2")
        record = json.loads((other / fp.checkpoint.RECORD).read_text())
        (other / fp.checkpoint.RECORD).write_text(json.dumps({**record, "id": "0bad"}))
        other = str(other)
    for message, untouched in world(4).run(_run_load_wrong, str(path), what, other):
        assert message is not None and re.search(match, message), message
        assert untouched


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_param_groups_by_index_still_loads(tmp_path):
    """Checkpoints written before the optimizer's groups were saved per parameter."""
    import torch.distributed.checkpoint as dcp

    from fusedpar.checkpoint import BY_GROUP, _state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    dcp.save(_state(model, optimizer, BY_GROUP), checkpoint_id=str(tmp_path))
    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(ValueError, match=r"no complete\.json.* require_record=False"):
        fp.checkpoint.load(str(tmp_path), fresh, fresh_optimizer)  # no record: DCP's own
    fp.checkpoint.load(str(tmp_path), fresh, fresh_optimizer, require_record=False)
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.5
    for param, before in zip(fresh.parameters(), model.parameters(), strict=True):
        saved = optimizer.state[before]["exp_avg"]
        assert torch.equal(fresh_optimizer.state[param]["exp_avg"], saved)


# --- one process: latest, overwrite, files, damage ------------------------------------


def _linear(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _weight_of(path) -> torch.Tensor:
    model = torch.nn.Linear(4, 3)
    fp.checkpoint.load(path, model)
    return model.weight.detach()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_latest_overwrite_files_and_damage_in_one_process(tmp_path):
    assert fp.checkpoint.latest(tmp_path / "none") is None
    assert fp.checkpoint.latest(tmp_path) is None
    for step in (2, 10, 9):  # newest by N, not by name or time
        fp.checkpoint.save(
            tmp_path / f"step-{step}",
            _linear(step),
            extra={"step": step},
            files={"notes.pt": {"step": step}},
        )
    fp.checkpoint.save(tmp_path / "final", _linear(0))  # other names: not considered
    assert fp.checkpoint.latest(tmp_path) == str(tmp_path / "step-10")
    assert torch.load(tmp_path / "step-10" / "notes.pt") == {"step": 10}
    record = json.loads((tmp_path / "step-10" / fp.checkpoint.RECORD).read_text())
    assert record["step"] == 10 and record["world_size"] == 1
    assert set(record["files"]) == {".metadata", "__0_0.distcp", "notes.pt"}
    # a step-N without a record (DCP's own save) is skipped, and said so
    shutil.copytree(tmp_path / "step-10", tmp_path / "step-11")
    (tmp_path / "step-11" / fp.checkpoint.RECORD).unlink()
    with pytest.warns(UserWarning, match=r"latest\(.*\): no complete checkpoint among step-11"):
        assert fp.checkpoint.latest(tmp_path) == str(tmp_path / "step-10")

    # an existing checkpoint: refused, or replaced with overwrite=True, nothing left beside
    with pytest.raises(FileExistsError, match="a checkpoint exists at .*step-2: pass overwrite"):
        fp.checkpoint.save(tmp_path / "step-2", _linear(7))
    assert torch.equal(_weight_of(tmp_path / "step-2"), _linear(2).weight)
    fp.checkpoint.save(tmp_path / "step-2", _linear(7), overwrite=True)
    assert torch.equal(_weight_of(tmp_path / "step-2"), _linear(7).weight)
    assert not (tmp_path / "step-2" / "notes.pt").exists()
    assert not list(tmp_path.glob(".step-2.*"))

    # files: plain names of their own only, refused before anything is written
    for name in ("../x.pt", ".hidden", fp.checkpoint.RECORD, "__0_0.distcp", ""):
        with pytest.raises(ValueError, match="not a plain file name"):
            fp.checkpoint.save(tmp_path / "step-20", _linear(0), files={name: 1})
    assert not list(tmp_path.glob("*step-20*"))

    # damage after the save: a file shorter than its record says, or missing
    with open(tmp_path / "step-9" / "notes.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"step-9 is damaged: notes\.pt is \d+ bytes, its "):
        _weight_of(tmp_path / "step-9")
    (tmp_path / "step-9" / "notes.pt").unlink()
    with pytest.raises(ValueError, match=r"step-9 is incomplete: notes\.pt, listed in its"):
        fp.checkpoint.load(tmp_path / "step-9", torch.nn.Linear(4, 3))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*: it holds neither"):
        (tmp_path / "empty").mkdir()
        fp.checkpoint.load(tmp_path / "empty", torch.nn.Linear(4, 3))

    # asynchronous, one process: the state when called, whatever happens after
    model = _linear(3)
    pending = fp.checkpoint.save(tmp_path / "step-30", model, async_save=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert pending.wait() == str(tmp_path / "step-30") and pending.done()
    assert torch.equal(_weight_of(tmp_path / "step-30"), _linear(3).weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # step-11 is skipped: the newest wins
        assert fp.checkpoint.latest(tmp_path) == str(tmp_path / "step-30")


# --- a rank that calls save or load alone: a clear error, not a hang -------------------


def _run_called_alone(root: str) -> dict:
    """Rank 0 calls save (blocking, then asynchronously) and load alone, the others wait
    in a barrier: its errors, and whether anything was written or loaded. Then every
    rank's save and load go through (the ranks still in step), a save on rank 0 meets a
    load on the others, and a bad timeout is refused by every rank. The calls rank 0
    makes alone wait 0.5 s; those every rank makes, 60 s (a rank descheduled on a loaded
    machine still arrives in time)."""
    try:
        rank, root = dist.get_rank(), Path(root)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        out = {"errors": []}
        path = root / "ckpts" / "step-1"
        if rank == 0:
            os.environ[TIMEOUT_ENV] = "0.5"
            for kwargs in ({}, {"async_save": True}):
                out["errors"].append(exception_of(fp.checkpoint.save, path, model, **kwargs))
            out["written"] = sorted(p.name for p in root.iterdir())
        os.environ[TIMEOUT_ENV] = "60"
        dist.barrier()
        fp.checkpoint.save(path, model)
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        if rank == 0:
            os.environ[TIMEOUT_ENV] = "0.5"
            out["errors"].append(exception_of(fp.checkpoint.load, path, model))
            out["loaded alone"] = not torch.equal(model.weight, saved + 1.0)
            os.environ[TIMEOUT_ENV] = "60"
        dist.barrier()
        fp.checkpoint.load(path, model)
        out["loaded"] = torch.equal(model.weight, saved)
        call = fp.checkpoint.save if rank == 0 else fp.checkpoint.load
        out["mixed"] = exception_of(call, root / "ckpts" / "step-2", model)
        os.environ[TIMEOUT_ENV] = "soon"
        out["bad timeout"] = exception_of(fp.checkpoint.save, root / "ckpts" / "step-3", model)
        out["listing"] = sorted(p.name for p in (root / "ckpts").iterdir())
        return out
    finally:
        os.environ.pop(TIMEOUT_ENV, None)


def test_a_save_or_load_called_on_one_rank_fails_naming_the_others(world, tmp_path):
    """The habit of one GPU (``if rank == 0: save(...)``): rank 0 raises TimeoutError
    after FUSEDPAR_CHECKPOINT_TIMEOUT_S, naming ranks 1-3, with nothing written (not even
    the parent directory) or loaded; the others, which called nothing, return."""
    results = world(4).run(_run_called_alone, str(tmp_path))
    alone = results[0]
    assert alone["written"] == []
    assert alone["loaded alone"] is False
    for error, call, what in zip(
        alone["errors"], ["save", "save", "load"], ["written", "written", "read"], strict=True
    ):
        assert isinstance(error, TimeoutError), repr(error)
        assert re.fullmatch(
            rf"fp\.checkpoint\.{call} is collective: ranks 1, 2, 3 of 4 did not call it "
            rf"within 0\.5 s \({TIMEOUT_ENV}\)\. Every rank must call it \(not rank 0 alone, "
            rf"as on one GPU\); nothing was {what}",
            str(error),
        ), str(error)
    for rank, out in enumerate(results):
        assert out["loaded"], rank
        assert isinstance(out["mixed"], ValueError) and re.fullmatch(
            r"the ranks made different checkpoint calls at once \(rank 0: fp\.checkpoint\."
            r"save, rank 1: fp\.checkpoint\.load\): every rank must make the same one",
            str(out["mixed"]),
        ), repr(out["mixed"])
        assert isinstance(out["bad timeout"], ValueError) and re.fullmatch(
            rf"{TIMEOUT_ENV} must be a number of seconds > 0 \(default 120\), got 'soon'",
            str(out["bad timeout"]),
        ), repr(out["bad timeout"])
        assert out["listing"] == ["step-1"], out["listing"]


class _Forced:
    """One rank's view of a store shared by threads: after its `add` to a key of
    `after`, it runs that key's function (an order forced by the test, not by timing)."""

    def __init__(self, store, after: dict):
        self.store, self.after = store, dict(after)

    def add(self, key, value):
        result = self.store.add(key, value)
        if key in self.after:
            self.after.pop(key)()
        return result

    def __getattr__(self, name):
        return getattr(self.store, name)


def _meet_in_threads(store, n: int, last: int, ranks: dict) -> dict:
    """`enter`'s wait (meet, then tidy) for each of `ranks` {rank: (timeout, after, first)}
    in a thread of its own, of 4 ranks: {rank: the round met, or the error raised}, once
    every thread has ended (none hangs). `first`: events the rank waits for before it
    comes (the others' steps), `after`: as `_Forced`."""
    out = {}

    def rank_main(rank, timeout, after, first):
        try:
            for event in first:
                assert event.wait(60)
            gen = meet(_Forced(store, after), n, rank, 4, "fp.checkpoint.save", "written", timeout)
            tidy(store, n, gen, rank, last)
            out[rank] = gen
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r, *plan)) for r, plan in ranks.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    return out


def test_the_ranks_agree_on_entering_even_when_one_comes_as_another_gives_up():
    """`enter`'s verdict is one for all, in any order of the store's calls (forced here
    in threads over one store): a rank that comes just after another gave up raises too,
    naming it, rather than passing alone into the first collective; a rank that came
    before the give-up but had not yet been counted passes with the others; the calls
    stay in step and their keys are deleted."""
    store = dist.HashStore()
    entry, verdict = "fusedpar/checkpoint/0.{}/in/{}".format, "fusedpar/checkpoint/0.{}/verdict"

    def then_wait(event, gen):  # signal the rank that gives up, stall until it has
        return lambda: (event.set(), store.wait([verdict.format(gen)], timedelta(seconds=60)))

    # call 0, round 0: rank 1 waits; rank 2 looks up the round, then stalls until rank 0
    # (0.01 s) has given up; rank 3 never comes
    events = [threading.Event() for _ in range(2)]
    ranks = {0: (0.01, {}, events), 1: (60, {entry(0, 1): events[0].set}, [])}
    ranks[2] = (60, {"fusedpar/checkpoint/0/gen": then_wait(events[1], 0)}, [])
    out = _meet_in_threads(store, 0, 0, ranks)
    missed = rf"ranks 2, 3 of 4 did not call it within 0\.01 s \({TIMEOUT_ENV}\)"
    must = r"\. Every rank must call it \(not rank 0 alone, as on one GPU\); nothing was written"
    for rank in (0, 1):
        assert isinstance(out[rank], TimeoutError), (rank, out[rank])
        assert re.fullmatch(rf"fp\.checkpoint\.save is collective: {missed}{must}", str(out[rank]))
    assert isinstance(out[2], TimeoutError) and re.fullmatch(
        rf"fp\.checkpoint\.save is collective: rank 0 gave up after 0\.01 s \({TIMEOUT_ENV}\) "
        rf"waiting for ranks 2, 3 of 4, before this rank \(2\) called it{must}",
        str(out[2]),
    ), repr(out[2])
    # call 0 again, round 1: rank 3 is in before rank 0 gives up, counted after it
    events = [threading.Event() for _ in range(3)]
    ranks = {r: (60, {entry(1, r): events[r - 1].set}, []) for r in (1, 2)}
    ranks[0] = (0.01, {}, events)
    ranks[3] = (60, {entry(1, 3): then_wait(events[2], 1)}, [])
    assert _meet_in_threads(store, 0, 0, ranks) == {0: 1, 1: 1, 2: 1, 3: 1}
    # call 1: every rank, at once; what is left is its own round
    ranks = {r: (60, {}, []) for r in range(4)}
    assert _meet_in_threads(store, 1, 1, ranks) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert store.num_keys() == 11  # call 1's: its round counter, 4 calls, 4 entries, count, verdict
