"""The compile gate's shared pieces (`fusedpar.testing.compile_gate` runs them):
`Cases`, a family's cases by name with `add` and `add_configs`, and the scenarios'
helpers (`_empty`, `_fp32_precision`, `_tma`). Each family folder's `cases` module builds
its `GATE_CASES` with them; tests/test_compile_gate.py runs them all."""

import contextlib
import math

import torch
from fusedpar.kernels import common

from fusedpar.testing import compile_gate as gate

# --- scenarios: the launchers called as the library calls them -------------------------
# They run in the gate's worker processes, on CPU tensors whose contents do not matter
# (nothing is launched), with shapes that give the specialisation of a real run: sizes
# divisible by 16, contiguous (unit inner strides), B and Hkv > 1.


def _empty(shape, dtype):
    return torch.empty(shape, dtype=getattr(torch, dtype))


@contextlib.contextmanager
def _fp32_precision(precision):
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


@contextlib.contextmanager
def _tma(allowed):
    """With `allowed` False, the launchers find no input TMA can read: the kernels'
    pointer path, as an A100 (or tiles TMA cannot address) gets it, on aligned tensors."""
    saved = common.tma_compatible
    if not allowed:
        common.tma_compatible = lambda *tensors: False
    try:
        yield
    finally:
        common.tma_compatible = saved


BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
# Kernels that read tiles through TMA descriptors where the launcher finds them usable
# (`common.tma_compatible`): always on the gate's aligned CPU tensors, never on an A100.
TMA_KERNELS = {
    "_attn_fwd_kernel": ("TMA", "OUT_TMA"),
    "_attn_bwd_dq_kernel": ("TMA",),
    "_attn_bwd_dkdv_kernel": ("TMA", "OUT_TMA", "DQ_TMA"),
    "_matmul_kernel": ("TMA", "A_T", "B_T", "C_TMA"),
}


def _tile(config) -> str:
    if config is None:
        return "fixed"
    sizes = "x".join(str(config.kwargs[k]) for k in BLOCKS if k in config.kwargs)
    return f"{sizes} s{config.num_stages} w{config.num_warps}"


class Cases(dict):
    """A family's compile-gate cases by name (each a dict `compile_gate.run_cases` takes)."""

    def add(
        self,
        family,
        variant,
        scenario,
        params,
        kernel,
        cap,
        config=None,
        *,
        no_spill,
        wgmma=False,
        match=None,
        loop_axis=None,
        loop_spill_only=False,
    ):
        """One case. `family`/`variant` group the report's rows; `no_spill` and `wgmma` say
        which rules apply beyond compiling within the shared-memory limit (every 16-bit
        sm_90 build also must not serialize its wgmma: ``no_serial``); `match` picks, among
        the scenario's launches of `kernel`, the first whose keyword arguments (constexpr
        flags) have these values; `loop_axis`: the config's block the hot loop advances by
        (the report gives instructions per 128 rows of it); ``loop_spill_only``: `no_spill`
        (and no_serial's spill check) hold for the hot loop only, the rest is reported."""
        tile = _tile(config)
        config = None if config is None else gate.config_kwargs(config)
        if cap == 80 and kernel in TMA_KERNELS:  # an A100 has no TMA: the launcher says so
            config = {**config, **dict.fromkeys(TMA_KERNELS[kernel], False)}
        sixteen_bit = params.get("dtype") in ("bfloat16", "float16")
        name = f"{family}-{variant}-{tile.replace(' ', '-')}-sm{cap}"
        assert name not in self, name
        self[name] = {
            "name": name,
            "scenario": gate.scenario_name(scenario),
            "params": params,
            "kernel": kernel,
            "cap": cap,
            "config": config,
            "family": family,
            "variant": variant,
            "tile": tile,
            "no_spill": no_spill and not loop_spill_only,
            "no_loop_spill": no_spill and loop_spill_only,
            "no_serial": sixteen_bit and cap == 90,
            "wgmma": wgmma,
            "match": match,
            "loop_step": config.get(loop_axis) if config and loop_axis else None,
        }

    def add_configs(
        self,
        family,
        variant,
        scenario,
        params,
        kernel,
        configs,
        *,
        no_spill,
        wgmma,
        match=None,
        loop_axis="BLOCK_K",
        loop_spill_only=False,
    ):
        """Every config for sm_90 (`wgmma`: the first, the largest, must use it)."""
        for i, config in enumerate(configs):
            self.add(
                family,
                variant,
                scenario,
                params,
                kernel,
                90,
                config,
                no_spill=no_spill,
                wgmma=wgmma and i == 0,
                match=match,
                loop_axis=loop_axis,
                loop_spill_only=loop_spill_only,
            )


def _smallest(configs):
    """The config with the smallest tile: the one the launchers' pruning always keeps."""
    return min(configs, key=lambda c: math.prod(c.kwargs.get(k, 1) for k in BLOCKS))
