"""The compile and resource gate: build Triton kernels for real GPUs on a machine with none.

The interpreter forgives what the GPU compiler rejects (non-power-of-2 ``arange``, dot
tiles under 16, unsupported ops), and it says nothing of registers, spills or shared
memory. The gate compiles kernels to cubin for a compute capability and reads what each
build uses:

| quantity          | source                                                             |
| ----------------- | ------------------------------------------------------------------ |
| registers         | ``REG`` of ``cuobjdump --dump-resource-usage`` (shipped with Triton) |
| spill bytes       | ``STACK + LOCAL`` of the same: the per-thread stack frame holds the |
|                   | spills (ptxas -v: a 120 B frame for 116 B of spill stores)         |
| shared memory     | ``compiled.metadata.shared`` (the dynamic part the launch asks for) |
|                   | plus cuobjdump's static ``SHARED``                                 |

``n_regs``/``n_spills`` of a compiled kernel are filled in only when a driver loads the
binary (a GPU), in triton 3.6 and 3.9 alike, so they are not used here.

**Cases come from the launchers' own calls.** A case names a *scenario*: a function that
calls a public launcher on small CPU tensors. The gate runs it with every
``kernel[grid](...)`` recorded instead of launched (`recording_launches`), then binds the
recorded arguments exactly as ``JITFunction.run`` does, so each build has the launcher's
real specialisation: 16-byte aligned pointers and integers divisible by 16 carry the
divisibility attribute, integers equal to 1 (unit strides, a GQA group of 1) become
constants, Python floats are fp32. A case may swap the recorded tile for another config
(``config``), which is how every tuning config of a kernel is built. A case is a dict::

    {"name": "attention-fwd-bf16-d128-...",            # unique, the test id
     "scenario": "test_compile_gate:attention_forward",  # module:function
     "params": {"dtype": "bfloat16", "head_dim": 128},   # JSON, passed as keyword args
     "kernel": "_attn_fwd_kernel",                        # which recorded launch to build:
     "match": {"CAUSAL": True},                           # the first of that kernel whose
                                                          # keyword arguments match (optional)
     "config": {"BLOCK_M": 128, "num_warps": 8, ...},    # or None: the recorded tile
     "cap": 90}

It must run where ``TRITON_INTERPRET`` is unset (the interpreter replaces the jit object
at decoration time), so `run_cases` compiles in a fresh process, with a pool of workers.
"""

import contextlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Shared memory a block may use (the opt-in maximum, static + dynamic) on A100 and H100.
SHARED_LIMIT = {80: 166912, 90: 232448}


@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``."""

    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recording_launches():
    """Inside, Triton launches are recorded (yielded list) instead of run, and fusedpar's
    launchers accept CPU tensors without the interpreter. The tuner takes its first
    candidate (``FUSEDPAR_TUNING=first``): each launcher call launches once."""
    from triton.runtime.jit import JITFunction

    import fusedpar.kernels
    from fusedpar.kernels import _common

    for info in pkgutil.iter_modules(fusedpar.kernels.__path__, "fusedpar.kernels."):
        importlib.import_module(info.name)
    checked = [m for name, m in sys.modules.items()
               if name.startswith("fusedpar") and getattr(m, "check_launchable", None)
               is _common.check_launchable]  # fmt: skip
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    saved_run, saved_tuning = JITFunction.run, os.environ.get("FUSEDPAR_TUNING")
    JITFunction.run = record
    os.environ["FUSEDPAR_TUNING"] = "first"
    for module in checked:
        module.check_launchable = _accept_any
    try:
        yield launches
    finally:
        JITFunction.run = saved_run
        for module in checked:
            module.check_launchable = _common.check_launchable
        if saved_tuning is None:
            os.environ.pop("FUSEDPAR_TUNING", None)
        else:
            os.environ["FUSEDPAR_TUNING"] = saved_tuning


def _accept_any(kernel, *tensors):
    return None


def compile_launch(launch: Launch, cap: int, config: dict | None = None):
    """Compile a recorded launch for ``sm_<cap>``, as ``JITFunction.run`` would on that GPU;
    `config` (tile sizes, ``num_warps``, ``num_stages``...) replaces the recorded ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    # The binder and `_pack_args` are the two steps `JITFunction.run` takes before it
    # compiles (triton 3.6 and 3.9 alike): using them, the gate cannot drift from what a
    # GPU run builds. A triton that renames them fails here loudly, not silently.
    kernel, kwargs = launch.kernel, {**launch.kwargs, **(config or {})}
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(compiled) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel, read from its cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    match = _USAGE.search(text)
    if match is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{text}")
    regs, stack, static_shared, local = map(int, match.groups())
    return {
        "regs": regs,
        "spill": stack + local,
        "shared": compiled.metadata.shared + static_shared,
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }


# --- running cases in worker processes ---------------------------------------------------


def config_kwargs(config) -> dict:
    """A `triton.Config` as the JSON keyword arguments a case's ``config`` holds."""
    return {k: v for k, v in config.all_kwargs().items() if v is not None}


def scenario_name(fn) -> str:
    """``module:function`` for a module-level scenario function."""
    return f"{fn.__module__}:{fn.__qualname__}"


_RECORDED: dict[str, list[Launch]] = {}


def _record(case: dict) -> list[Launch]:
    key = json.dumps([case["scenario"], case["params"]], sort_keys=True)
    if key not in _RECORDED:
        module, attr = case["scenario"].split(":")
        fn = getattr(importlib.import_module(module), attr)
        with recording_launches() as launches:
            fn(**case["params"])
        _RECORDED[key] = launches
    return _RECORDED[key]


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas runs as one): unlike
    wall time, it does not grow when other jobs share the cores."""
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_case(case: dict) -> dict:
    """Record the case's scenario (once per process), compile the chosen launch, measure."""
    import traceback

    result = {"name": case["name"], "ok": False, "error": "", "seconds": 0.0, "cpu_seconds": 0.0}
    try:
        kernel, match = case["kernel"], case.get("match") or {}
        found = [x for x in _record(case) if x.kernel.__name__ == kernel
                 and all(x.kwargs.get(k) == v for k, v in match.items())]  # fmt: skip
        if not found:
            raise RuntimeError(f"the scenario launched no {kernel} with {match}")
        start, cpu = time.perf_counter(), _cpu_seconds()
        compiled = compile_launch(found[0], case["cap"], case.get("config"))
        result["seconds"] = round(time.perf_counter() - start, 2)
        result["cpu_seconds"] = round(_cpu_seconds() - cpu, 2)
        result.update(resource_usage(compiled), ok=True)
    except Exception:
        result["error"] = traceback.format_exc()
    return result


def _worker_init(path: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:] = path


def run_cases(cases: list[dict], *, workers: int | None = None, timeout: float = 1800) -> list:
    """Compile `cases` in a fresh process without the interpreter, on `workers` processes
    (default: the CPUs this process may use, or ``FUSEDPAR_GATE_WORKERS``). Returns one
    dict per case, in order: ``ok``, ``error`` (a traceback), ``regs``, ``spill`` and
    ``shared`` (bytes), ``wgmma`` (the PTX uses Hopper's warpgroup MMA), ``seconds`` and
    ``cpu_seconds`` (compile time; near 0 when Triton's cache had the kernel)."""
    if workers is None:
        workers = int(os.environ.get("FUSEDPAR_GATE_WORKERS", 0)) or len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    request = {"cases": cases, "workers": workers, "path": sys.path}
    proc = subprocess.run([sys.executable, "-m", "fusedpar.testing.compile_gate"],
                          input=json.dumps(request), capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"compile gate process failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


# --- the report -------------------------------------------------------------------------


def resource_table(cases: list[dict], results: list[dict]) -> str:
    """docs/resources.md: a Markdown table per kernel family of what each case uses, with
    the compile time per family. Cases carry ``family``, ``variant``, ``tile`` and the
    rules that apply (``no_spill``, ``wgmma``); a list of the case names closes the page,
    so a test can tell when the page no longer matches the cases."""
    import triton

    lines = [
        "# Resources of every tuning config",
        "",
        "Generated by the resource gate (`tests/test_compile_gate.py`), not by hand: rerun",
        "`FUSEDPAR_WRITE_RESOURCES=1 pytest tests/test_compile_gate.py` after changing a",
        "kernel or a config list. Built with triton "
        f"{triton.__version__} for sm_90 (H100) and sm_80 (A100); nothing ran on a GPU.",
        "",
        "Columns: registers per thread; spilled bytes per thread (the stack frame);",
        "shared memory in KiB (static + dynamic, limits 227 KiB on sm_90 and 163 KiB on",
        "sm_80); whether the PTX uses wgmma; the CPU seconds the build took here (0 when",
        "Triton's cache had it); the rule the gate enforces beyond compiling within the",
        "shared-memory limit (`no spill`, `wgmma`, or `report` when the row is only reported).",
        "",
        "## Build time per family",
        "",
        "| family | builds | CPU s per build (mean, max) | CPU s in all |",
        "| --- | ---: | ---: | ---: |",
    ]
    families: dict[str, list] = {}
    for case, result in zip(cases, results, strict=True):
        families.setdefault(case["family"], []).append((case, result))
    for family, rows in families.items():
        times = [r["cpu_seconds"] for _, r in rows]
        lines.append(f"| {family} | {len(rows)} | {sum(times) / len(times):.1f}, "
                     f"{max(times):.1f} | {sum(times):.0f} |")  # fmt: skip
    for family, rows in families.items():
        lines += ["", f"## {family}", "",
                  "| variant | tile (M x N, stages, warps) | sm | regs | spill B | shared KiB "
                  "| wgmma | CPU s | rule |",
                  "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | --- |"]  # fmt: skip
        for case, r in rows:
            rule = ", ".join(k.replace("_", " ") for k in ("no_spill", "wgmma") if case.get(k))
            if not r["ok"]:
                lines.append(f"| {case['variant']} | {case['tile']} | {case['cap']} | "
                             "failed to build | | | | | |")  # fmt: skip
                continue
            lines.append(
                f"| {case['variant']} | {case['tile']} | {case['cap']} | {r['regs']} | "
                f"{r['spill']} | {r['shared'] / 1024:.1f} | {'yes' if r['wgmma'] else 'no'} | "
                f"{r['cpu_seconds']:.1f} | {rule or 'report'} |"
            )
    names = json.dumps(sorted(c["name"] for c in cases))
    return "\n".join(lines) + f"\n\n<!-- cases: {names} -->\n"


def _main() -> None:
    import multiprocessing

    request = json.load(sys.stdin)
    _worker_init(request["path"])
    cases, workers = request["cases"], max(1, min(request["workers"], len(request["cases"])))
    if workers == 1:
        results = [run_case(case) for case in cases]
    else:
        # spawn, not fork: each worker imports triton itself; imap hands out one case at a
        # time, so a slow build (an fp32 FMA tile) does not hold back a fixed share.
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, _worker_init, (request["path"],)) as pool:
            results = list(pool.imap(run_case, cases, chunksize=1))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()
