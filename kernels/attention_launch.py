"""Launching an attention kernel through the tuner: its tile list for the call's
specialisation (`kernel_modes`) pruned to the sequences, one tile sized to the problem in
the interpreter, torch's implementation and PyTorch's own kernels as candidates beside
the tiles, and a planned launcher's settled pick launched past the tuner. Used by the
forward (`attention`), the split and the fused backward."""

import triton
from fusedpar.kernels import _impl, _tuning
from fusedpar.kernels._common import device_guard, is_interpreted, next_power_of_2
from fusedpar.kernels._tuning import bucket
from fusedpar.kernels.attention_plan import launch_key

# The interpreter runs one program at a time in numpy: a few large tiles beat many small.
INTERPRETER_MAX_BLOCK = 64


def kernel_modes(meta: dict) -> frozenset:
    """What of a launch's specialisation a tile list may depend on: ``softcap`` (the
    tanh on every score), ``pointer`` (tiles read through pointers, not TMA) and
    ``accumulate`` (an fp32 output read back: a ring step's merge or added gradients).
    A tile that spills or serializes in a mode is left out of it."""
    return frozenset(mode for mode, on in (
        ("softcap", meta["SOFTCAP"]),
        ("pointer", not meta.get("TMA")),
        ("accumulate", meta.get("ACCUMULATE") or meta.get("MERGE")),
    ) if on)  # fmt: skip


def _prune_configs(configs, Sq: int, Skv: int):
    """Drop tiles far larger than the sequences; keep at least the smallest."""
    limit_m = max(32, next_power_of_2(Sq))
    limit_n = max(32, next_power_of_2(Skv))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= limit_m and c.kwargs["BLOCK_N"] <= limit_n]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def interpreter_blocks(Sq: int, Skv: int) -> dict:
    def block(n):
        return min(INTERPRETER_MAX_BLOCK, max(16, next_power_of_2(n)))

    return {"BLOCK_M": block(Sq), "BLOCK_N": block(Skv)}


def launch(
    kernel, configs, grid, args, meta, Sq, Skv, *, restore=(), agreement=None, tune_only=False,
    key_extra=(), torch_run=None, key=None, settled=None, platform=None,
):  # fmt: skip
    """Launch `kernel` with the tile tuned for (Sq and Skv buckets, `meta`, the dtypes,
    `key_extra`): one sized to the problem in the interpreter, else the best of
    ``configs()``. `grid(tile)` builds the grid; `restore`: buffers the kernel reads
    back (adds into, or merges with). `torch_run`: the torch implementation of the same
    call, a candidate too where given (CUDA, ``FUSEDPAR_IMPL=auto``). `key`: the tuner's
    key as `launch_key` makes it, from a launcher's plan; `settled`: that plan's
    `_tuning.Settled` per implementation asked for, launched past the tuner once the
    pick is made (and kept there after it). `platform`: ``platform()`` gives ``{candidate:
    run()}`` of PyTorch's own kernels for this call (`attention_platform`), candidates
    too where torch's is; the key must name them."""
    name = kernel.__name__
    request = None
    if settled is not None and agreement is None and not tune_only:
        request = _impl.requested()
        kept = settled.get(request)
        if kept is not None and _tuning.kept(name, kept.scope) is kept.config:
            kept.launch(kernel, args)
            return
    if key is None:
        key = launch_key(args, meta, Sq, Skv, key_extra, torch_run is not None)

    def candidates():
        if is_interpreted(kernel):
            tiles = [triton.Config(interpreter_blocks(bucket(Sq), bucket(Skv)))]
        else:
            configs_here = configs(meta["HEAD_DIM"], args[0].dtype, kernel_modes(meta),
                                   v_dim=meta["HEAD_DIM_V"])  # fmt: skip
            tiles = _prune_configs(configs_here, bucket(Sq), bucket(Skv))
        if not _impl.tunes_torch():
            return tiles
        return tiles + ([_impl.TORCH] if torch_run else []) + list(platform_runs())

    runs = {}

    def platform_runs():  # built once per call, when first needed
        if platform is not None and not runs:
            runs.update(platform())
        return runs

    def run(config):
        if isinstance(config, _impl.Torch):
            platform_runs().get(config, torch_run)()
        else:
            kernel[grid(config.kwargs)](*args, **meta, **config.all_kwargs())

    with device_guard(args[0]):
        config = _tuning.tuner(name).run(key, candidates, run, device=args[0].device,
                                         restore=restore, agreement=agreement,
                                         tune_only=tune_only)  # fmt: skip
    if request is not None and not isinstance(config, _impl.Torch):
        scope = _tuning.local_scope(key, request)
        if _tuning.kept(name, scope) is config:  # the pick (not a forced config)
            kwargs = {**meta, **config.all_kwargs()}
            settled[request] = _tuning.Settled.of(kernel, config, scope, grid(config.kwargs),
                                                  kwargs, len(args))  # fmt: skip
