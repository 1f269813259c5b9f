"""Choosing a kernel's tile: one tuner behind every launcher, kept out of the hot loops.

A launcher hands `Tuner.run` (``tuner(name)``) a key, the candidate configs and
``launch(config)``; the tuner returns the pick for that key, timing every candidate once
on a miss. Keys bucket lengths (`bucket`: the next power of two); buffers the kernel
reads back (``restore``) are copied aside and put back around the timing; a config that
does not compile is skipped; a candidate may be `impl.Torch`, torch's implementation.
`Launch` says how a call meets the tuner: an `Agreement` (each rank of a group times
every candidate, the times are summed in one collective, the lowest sum wins: one pick
on every rank) and ``tune_only`` (pick, launch nothing), with which ring and TP loops
tune before running inside `frozen()`, where a miss raises. `forced(name, config)` runs
one config for every key, untimed (tests); `Settled` keeps a planned launch's pick.

Environment, read when a pick is made: ``FUSEDPAR_TUNING=first`` (no timing),
``FUSEDPAR_TUNING_CACHE=path.json`` (picks made without a group, kept in a file),
``TRITON_PRINT_AUTOTUNING=1`` or ``FUSEDPAR_PRINT_TUNING=1`` (print each pick). Kernels
know nothing of ``torch.distributed``: an `Agreement`'s collective is built in
`fusedpar.comm`. The rules and why: docs/architecture.md, "Tuning".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from fusedpar.kernels import impl
from fusedpar.kernels.common import device_guard, next_power_of_2

_FROZEN = contextvars.ContextVar("fusedpar_tuning_frozen", default=None)
_FORCED = contextvars.ContextVar("fusedpar_tuning_forced", default=None)
_TUNERS: dict[str, Tuner] = {}


def bucket(n: int) -> int:
    """The tuning bucket of a length: the next power of two (0 stays 0)."""
    return next_power_of_2(n) if n > 0 else 0


@dataclass(frozen=True, slots=True)
class Settled:
    """A planned launch's settled pick and what launching it takes, kept beside its plan:
    `config` the pick, valid while ``kept(tuner name, scope) is config``; `grid`; `tail` the
    kernel's parameters after those a call passes (its constexprs, in the kernel's
    order), and `options` Triton's (num_warps, num_stages, ...). A launch passes them
    positionally to the kernel's ``run``: binding 19 keywords and a grid lambda cost a
    GEMM call about 2.5 µs of host time (the interpreter's launch; Triton's binder on a
    GPU binds positional arguments too)."""

    config: object
    scope: tuple
    grid: tuple
    tail: tuple
    options: dict

    @staticmethod
    def of(kernel, config, scope: tuple, grid: tuple, kwargs: dict, given: int) -> Settled:
        """`kwargs` (a launch's keywords) split after the kernel's first `given`
        parameters (those the call passes)."""
        names = kernel.arg_names[given:]
        tail = tuple(kwargs[name] for name in names)
        options = {k: v for k, v in kwargs.items() if k not in names}
        return Settled(config, scope, grid, tail, options)

    def launch(self, kernel, args: tuple) -> None:
        """`kernel` on a call's own arguments `args` and the kept constexprs."""
        if not args[0].is_cuda:  # the interpreter
            kernel.run(*args, *self.tail, grid=self.grid, warmup=False, **self.options)
            return
        with device_guard(args[0]):
            kernel.run(*args, *self.tail, grid=self.grid, warmup=False, **self.options)


@dataclass(frozen=True)
class Agreement:
    """Ranks that must pick the same configs. `name` names the group (its picks are kept
    apart from the local ones); `sum_times` sums a list of times over the group's ranks
    (a collective: every rank tunes the same keys in the same order, which holds because
    the ops that pass an agreement are collective calls with equal shapes)."""

    name: str
    sum_times: Callable[[list[float]], list[float]]


@dataclass(frozen=True, slots=True)
class Launch:
    """How a launcher's call meets the tuner, one value from the loop that decides it down
    to `Tuner.run`: `agreement` (the ranks that pick together, or None: a local pick)
    and `tune_only` (make the pick, on scratch where the call would write, and launch
    nothing: a ring or TP loop tunes its launches before its first transfer)."""

    agreement: Agreement | None = None
    tune_only: bool = False

    @property
    def plain(self) -> bool:
        """A local pick, launched: what a planned launch may take past the tuner."""
        return self.agreement is None and not self.tune_only


LAUNCH = Launch()  # the default: a local pick, launched


@contextlib.contextmanager
def frozen(where: str, agreement: Agreement | None):
    """Inside, a launch whose pick was not made before, or that names another agreement,
    raises: for ring and TP loops, which tune before their first transfer (timing a
    kernel while NCCL moves data gives noisy picks and delays the transfer)."""
    token = _FROZEN.set((where, agreement.name if agreement else None))
    try:
        yield
    finally:
        _FROZEN.reset(token)


@contextlib.contextmanager
def forced(name: str, config: triton.Config):
    """Inside, tuner `name` launches `config` for every key, with no timing and no pick
    kept: tests run each config of a list in turn (a config the tuner never picks is
    still checked for correctness)."""
    token = _FORCED.set({**(_FORCED.get() or {}), name: config})
    try:
        yield
    finally:
        _FORCED.reset(token)


class NoConfigCompiles(RuntimeError):
    """No candidate of a key compiled. A candidate that is itself a tuned launch (the
    fused attention backward, one candidate of tuner ``attention_backward``) that raises
    it is skipped as one that does not compile."""


def _compile_errors() -> tuple[type[BaseException], ...]:
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime import errors

    found = [CompileTimeAssertionFailure, errors.OutOfResources, NoConfigCompiles]
    if hasattr(errors, "PTXASError"):
        found.append(errors.PTXASError)
    return tuple(found)


def _time_ms(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    times = []  # the interpreter: wall time of a few runs
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _describe(config) -> dict:
    if isinstance(config, impl.Torch):
        return {"implementation": config.name}
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
            "num_stages": config.num_stages}  # fmt: skip


def _verbose() -> bool:
    names = ("TRITON_PRINT_AUTOTUNING", "FUSEDPAR_PRINT_TUNING")
    return any(os.environ.get(name) == "1" for name in names)


def _full_key(key: tuple) -> tuple:
    """A launcher's key with the implementation asked for (its candidates depend on it)."""
    return (*key, ("implementation", impl.requested()))


def local_scope(key: tuple, request: str) -> tuple:
    """Where `Tuner.picks` keeps the pick made for `key` with no agreement, under the
    implementation `request` (`impl.requested`)."""
    return None, (*key, ("implementation", request))


class Tuner:
    """The picks of one kernel: ``{(group name or None, key): config}``."""

    def __init__(self, name: str):
        self.name = name
        self.picks: dict[tuple, triton.Config] = {}
        self.timings: dict[tuple, list[float]] = {}
        self.tuned = 0  # how many keys were timed (tests read it)
        self._disk_loaded = False

    def has(self, key: tuple, agreement: Agreement | None = None) -> bool:
        """Whether the pick for `key` is made (in `agreement`'s group, or locally)."""
        return (agreement.name if agreement else None, _full_key(key)) in self.picks

    def settled(self, key: tuple) -> triton.Config | None:
        """The config `run` would launch for `key` (no agreement) with nothing to do
        first: the pick, when it is made and no forced config or frozen loop is in
        force; else None (then `run` it). A planned launcher that kept its arguments
        for that pick launches with them directly (host time: bench/host_overhead.py)."""
        return kept(self.name, local_scope(key, impl.requested()))

    def run(
        self,
        key: tuple,
        candidates: Callable[[], Sequence[triton.Config]],
        launch: Callable[[triton.Config], None],
        *,
        device: torch.device,
        restore: Sequence[torch.Tensor] = (),
        launch_as: Launch = LAUNCH,
    ) -> triton.Config:
        """Launch with the pick for `key` (timing the configs ``candidates()`` lists first
        on a miss: they are built only then, not on every launch). `launch_as` (`Launch`):
        the group that picks together, and with ``tune_only`` make the pick if missing and
        launch nothing more. A candidate may be `impl.Torch` (``launch`` then runs the
        torch implementation); the implementation asked for (`impl.requested`) is part of
        the key."""
        agreement, tune_only = launch_as.agreement, launch_as.tune_only
        key = _full_key(key)
        config = (_FORCED.get() or {}).get(self.name)
        if config is not None:
            if not tune_only:
                launch(config)
            return config
        scope = (agreement.name if agreement else None, key)
        where, frozen_group = _FROZEN.get() or (None, None)
        if where is not None and frozen_group != scope[0]:
            raise RuntimeError(f"{self.name}: launched inside {where} (tuned for "
                               f"{frozen_group}) with agreement {scope[0]}")  # fmt: skip
        config = self.picks.get(scope)
        if config is None and agreement is None:
            config = self._from_disk(key, candidates())
        if config is None:
            if where is not None:
                raise RuntimeError(
                    f"{self.name}: no tile picked for key {key} inside {where}, which tunes "
                    f"before its loop: the loop launched a kernel its tuning step did not cover"
                )
            config = self._tune(scope, candidates(), launch, device, restore, agreement)
            if tune_only:
                return config
        elif tune_only:
            return config
        launch(config)
        return config

    def _tune(self, scope, candidates, launch, device, restore, agreement) -> triton.Config:
        if not candidates:
            raise ValueError(f"{self.name}: no candidate config for key {scope[1]}")
        timed = len(candidates) > 1 and os.environ.get("FUSEDPAR_TUNING") != "first"
        if not timed:
            times = [0.0] + [float("inf")] * (len(candidates) - 1)
        else:
            saved = [t.clone() for t in restore]
            times = []
            for config in candidates:
                try:
                    launch(config)  # compiles outside the timing
                    times.append(_time_ms(lambda c=config: launch(c), device))
                except _compile_errors():
                    times.append(float("inf"))
                except Exception:  # torch's implementation failed here (out of memory, a
                    # shape it refuses): never picked, never the end of the tuning
                    if not isinstance(config, impl.Torch):
                        raise
                    times.append(float("inf"))
            for t, s in zip(restore, saved, strict=True):
                t.copy_(s)
            if agreement is not None:
                times = agreement.sum_times(times)
        best = min(range(len(candidates)), key=lambda i: times[i])
        if times[best] == float("inf"):
            raise NoConfigCompiles(f"{self.name}: no candidate config compiles for key {scope[1]}")
        config = candidates[best]
        self.picks[scope] = config
        self.timings[scope] = times
        self.tuned += 1
        if _verbose():
            where = f" (agreed over {scope[0]})" if scope[0] else ""
            print(f"fusedpar tuning: {self.name} {scope[1]} -> {config} "
                  f"{times[best]:.4f} ms{where}")  # fmt: skip
        if scope[0] is None and timed:  # an untimed pick must not pass for a tuned one
            self._to_disk(scope[1], config)
        return config

    # --- the optional file of picks (FUSEDPAR_TUNING_CACHE) ---

    def _from_disk(self, key, candidates) -> triton.Config | None:
        path = os.environ.get("FUSEDPAR_TUNING_CACHE")
        if not path or not Path(path).exists():
            return None
        entry = json.loads(Path(path).read_text()).get(self.name, {}).get(repr(key))
        for config in candidates:  # only a pick that is still a candidate counts
            if entry is not None and _describe(config) == entry:
                self.picks[(None, key)] = config
                return config
        return None

    def _to_disk(self, key, config) -> None:
        path = os.environ.get("FUSEDPAR_TUNING_CACHE")
        if not path:
            return
        file = Path(path)
        data = json.loads(file.read_text()) if file.exists() else {}
        data.setdefault(self.name, {})[repr(key)] = _describe(config)
        file.write_text(json.dumps(data, indent=1, sort_keys=True))


def kept(name: str, scope: tuple) -> triton.Config | None:
    """`Tuner.settled` of tuner `name` for a `local_scope` that a planned launcher keeps
    beside its arguments (`Settled`): the pick, while no forced config or frozen loop is
    in force; else None."""
    if _FORCED.get() is not None or _FROZEN.get() is not None:
        return None
    found = _TUNERS.get(name)
    return None if found is None else found.picks.get(scope)


def tuner(name: str) -> Tuner:
    """The process's tuner for the kernel called `name` (made on first use)."""
    if name not in _TUNERS:
        _TUNERS[name] = Tuner(name)
    return _TUNERS[name]


@functools.cache
def _fixed_config(tile: tuple) -> triton.Config:
    """A row kernel's fixed tile as a ``triton.Config``, made once (~2 µs a call)."""
    tile = dict(tile)
    return triton.Config(tile, num_warps=tile.pop("num_warps"))


def run_tile_or_torch(kernel, tile: dict, grid, args, meta, key, device_tensor, torch_run):
    """Launch `kernel` with its one fixed tile (`tile`: the meta-parameters and
    "num_warps"), or on CUDA under ``FUSEDPAR_IMPL=auto`` whichever of that tile and
    `torch_run` the tuner measured faster for `key`: the row kernels (MoE permute and
    combine, RMSNorm), whose ranks each pick on their own. ``grid(tile)`` builds the
    grid from the tile's meta-parameters."""
    config = _fixed_config(tuple(tile.items()))
    if tuner(kernel.__name__).settled(key) is config:  # the tile is the pick: launch it
        with device_guard(device_tensor):
            kernel[grid(config.kwargs)](*args, **meta, **config.all_kwargs())
        return

    def candidates():
        return [config, *([impl.TORCH] if impl.tunes_torch() else [])]

    def launch(choice):
        if isinstance(choice, impl.Torch):
            torch_run()
        else:
            kernel[grid(choice.kwargs)](*args, **meta, **choice.all_kwargs())

    with device_guard(device_tensor):
        tuner(kernel.__name__).run(key, candidates, launch, device=device_tensor.device)


def all_picks() -> dict[str, dict[str, dict]]:
    """Every pick made so far, ``{kernel: {"key [group]": config}}``: benchmarks record it."""
    return {
        name: {f"{key}{f' [{group}]' if group else ''}": _describe(c)
               for (group, key), c in t.picks.items()}
        for name, t in _TUNERS.items()
    }  # fmt: skip


def forget_picks() -> None:
    """Drop every pick of this process (tests start from a clean slate with it)."""
    _TUNERS.clear()
