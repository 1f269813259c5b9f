"""The compile and resource gate: build Triton kernels for real GPUs on a machine with none.

The interpreter forgives what the GPU compiler rejects and says nothing of registers,
spills or shared memory; the gate compiles each case to cubin for a compute capability,
reading what the build uses (`compile_launch`, `run_case`): registers, spilled bytes,
shared memory, ptxas's notes and the SASS hot loop (`machine_code`). `run_cases` runs
them in fresh processes without ``TRITON_INTERPRET``, compiling only the cases whose key
(Triton's cache key plus the readers' source) is not in the cache (`load_cache`). A
case's *scenario* calls a public launcher on small CPU tensors under
`recording_launches`; the recorded launch is built with a GPU's specialisation::

    {"name": "attention-fwd-bf16-d128-...",            # unique, the test id
     "scenario": "test_compile_gate:attention_forward",  # module:function
     "params": {"dtype": "bfloat16", "head_dim": 128},   # JSON, passed as keyword args
     "kernel": "_attn_fwd_kernel",                        # the recorded launch to build:
     "match": {"CAUSAL": True},                           # the first that matches (optional)
     "config": {"BLOCK_M": 128, "num_warps": 8, ...},    # or None: the recorded tile
     "cap": 90}

What is read from where, and the specialisation: docs/testing.md, "Adding a kernel to the gate".
"""

import contextlib
import hashlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import fusedpar.kernels
from fusedpar.kernels.common import check_launchable
from fusedpar.kernels.impl import implementation
from fusedpar.testing import machine_code

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
    launchers accept CPU tensors without the interpreter and take Triton's kernels
    (``fusedpar.implementation("triton")``). The tuner takes its first candidate
    (``FUSEDPAR_TUNING=first``): each launcher call launches once."""
    from triton.runtime.jit import JITFunction

    for info in pkgutil.iter_modules(fusedpar.kernels.__path__, "fusedpar.kernels."):
        importlib.import_module(info.name)
    checked = [
        m
        for name, m in sys.modules.items()
        if name.startswith("fusedpar") and getattr(m, "check_launchable", None) is check_launchable
    ]
    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        # a settled launch (`tuning.Settled`) passes the constexprs positionally: keyword
        # them, as ``kernel[grid](...)`` does, so that a case's `match` and `config` see them
        first = next((i for i, p in enumerate(self.params) if p.is_constexpr), len(args))
        kwargs = {
            **dict(zip(self.arg_names[first : len(args)], args[first:], strict=True)),
            **kwargs,
        }
        launches.append(Launch(self, args[:first], kwargs))

    saved_run, saved_tuning = JITFunction.run, os.environ.get("FUSEDPAR_TUNING")
    JITFunction.run = record
    os.environ["FUSEDPAR_TUNING"] = "first"
    for module in checked:
        module.check_launchable = _accept_any
    try:
        with implementation("triton"):
            yield launches
    finally:
        JITFunction.run = saved_run
        for module in checked:
            module.check_launchable = check_launchable
        if saved_tuning is None:
            os.environ.pop("FUSEDPAR_TUNING", None)
        else:
            os.environ["FUSEDPAR_TUNING"] = saved_tuning


def _accept_any(kernel, *tensors):
    return None


def _source(launch: Launch, cap: int, config: dict | None):
    """What ``JITFunction.run`` would compile for this launch on ``sm_<cap>``: the
    source, the target and the options; `config` (tile sizes, ``num_warps``,
    ``num_stages``...) replaces the recorded ones."""
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
    return ASTSource(kernel, signature, constexprs, attrs), target, options.__dict__


def _reader_source() -> str:
    """The readers' own source: a change to how a build is read invalidates the cache."""
    import inspect

    with open(machine_code.__file__) as f:
        readers = f.read() + inspect.getsource(_read_build)
    return hashlib.sha256(readers.encode()).hexdigest()


def build_key(src, target, options: dict) -> str:
    """Triton's cache key of the build (sha256), extended with the readers' source."""
    from triton.compiler import make_backend
    from triton.compiler.compiler import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    backend = make_backend(target)
    key = get_cache_key(
        src, backend, backend.parse_options(options), get_cache_invalidating_env_vars()
    )
    return hashlib.sha256(f"{key}-{_reader_source()}".encode()).hexdigest()


def compile_launch(launch: Launch, cap: int, config: dict | None = None):
    """Compile a recorded launch for ``sm_<cap>``, as ``JITFunction.run`` would on that
    GPU. Returns ``(compiled, ptxas log)``: Triton is made to compile even when its own
    cache has the kernel, so ptxas always runs and its log is caught."""
    import triton
    from triton import knobs

    src, target, options = _source(launch, cap, config)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(src, target=target, options=options)
    return compiled, log.getvalue()


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _read_build(compiled, log: str) -> dict:
    """Registers, spill bytes and shared memory of a compiled kernel (from its cubin),
    whether its PTX uses wgmma, ptxas's coded notes and the SASS hot loop."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])

        def cuobjdump(flag):
            return subprocess.run(
                [os.path.join(tools, "cuobjdump"), flag, path],
                capture_output=True,
                text=True,
                check=True,
            ).stdout

        usage, sass = cuobjdump("--dump-resource-usage"), cuobjdump("-sass")
    match = _USAGE.search(usage)
    if match is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{usage}")
    regs, stack, static_shared, local = map(int, match.groups())
    return {
        "regs": regs,
        "spill": stack + local,
        "shared": compiled.metadata.shared + static_shared,
        "wgmma": "wgmma" in compiled.asm["ptx"],
        "notes": machine_code.ptxas_notes(log),
        "serialized": machine_code.wgmma_serialized(log),
        "loop": machine_code.hot_loop(machine_code.parse_sass(sass)),
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


def _launch_of(case: dict) -> Launch:
    kernel, match = case["kernel"], case.get("match") or {}
    found = [
        x
        for x in _record(case)
        if x.kernel.__name__ == kernel and all(x.kwargs.get(k) == v for k, v in match.items())
    ]
    if not found:
        raise RuntimeError(f"the scenario launched no {kernel} with {match}")
    return found[0]


def case_key(case: dict) -> str:
    """The case's `build_key` (recording its scenario once per process)."""
    return build_key(*_source(_launch_of(case), case["cap"], case.get("config")))


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
    """Record the case's scenario (once per process), compile the chosen launch, read it."""
    import traceback

    result = {
        "name": case["name"],
        "ok": False,
        "error": "",
        "seconds": 0.0,
        "cpu_seconds": 0.0,
        "cached": False,
    }
    try:
        launch = _launch_of(case)
        result["key"] = case_key(case)
        start, cpu = time.perf_counter(), _cpu_seconds()
        compiled, log = compile_launch(launch, case["cap"], case.get("config"))
        result["seconds"] = round(time.perf_counter() - start, 2)
        result["cpu_seconds"] = round(_cpu_seconds() - cpu, 2)
        result.update(_read_build(compiled, log), ok=True)
    except Exception:
        result["error"] = traceback.format_exc()
    return result


def _worker_init(path: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:] = path


def run_cases(
    cases: list[dict],
    *,
    cache: dict | None = None,
    workers: int | None = None,
    timeout: float = 1800,
) -> list:
    """Build `cases` in a fresh process without the interpreter, on `workers` processes
    (default: the CPUs this process may use, or ``FUSEDPAR_GATE_WORKERS``); a case whose
    `build_key` is in `cache` (key: result) takes the cached result instead. Returns one
    dict per case, in order: ``ok``, ``error`` (a traceback), ``regs``, ``spill`` and
    ``shared`` (bytes), ``wgmma`` (the PTX uses Hopper's warpgroup MMA), ``notes``
    (ptxas's codes), ``serialized`` (the wgmma were), ``loop``
    (`machine_code.hot_loop`), ``seconds`` and ``cpu_seconds`` (of the build, when it was
    built), ``key`` and ``cached``."""
    if workers is None:
        workers = int(os.environ.get("FUSEDPAR_GATE_WORKERS", 0)) or len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    request = {"cases": cases, "workers": workers, "path": sys.path, "cache": cache or {}}
    proc = subprocess.run(
        [sys.executable, "-m", "fusedpar.testing.compile_gate"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compile gate process failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


# The fields of a result that depend on the build alone (what the cache keeps).
_BUILD_FIELDS = (
    "ok",
    "error",
    "regs",
    "spill",
    "shared",
    "wgmma",
    "notes",
    "serialized",
    "loop",
    "seconds",
    "cpu_seconds",
)


def load_cache(path) -> dict:
    """The cached results in `path` (key: result); empty when there is no such file."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["builds"]


def save_cache(path, results: list[dict]) -> None:
    """Write the successful `results` as the cache (only these: older keys are dropped)."""
    import triton

    builds = {r["key"]: {k: r[k] for k in _BUILD_FIELDS if k in r} for r in results if r["ok"]}
    with open(path, "w") as f:
        json.dump(
            {"triton": triton.__version__, "builds": dict(sorted(builds.items()))},
            f,
            indent=0,
            sort_keys=True,
        )
        f.write("\n")


# --- the report -------------------------------------------------------------------------


def _loop_columns(case: dict, r: dict) -> list[str]:
    """The hot loop's columns: HGMMA per iteration by shape, wgmma waits, loads
    (TMA / cp.async / LDG), local-memory accesses, instructions per iteration (shortest
    path, and the longest when it differs) and, for a case with a ``loop_step`` (the
    loop's rows per iteration), instructions per 128 of them."""
    loop = r.get("loop")
    if not loop:
        return ["", "", "", "", "", ""]
    mma = ", ".join(f"{n}x {shape}" for shape, n in loop["hgmma"].items())
    loads = loop["loads"]
    insts = str(loop["insts_min"])
    if loop["insts_max"] != loop["insts_min"]:
        insts += f"-{loop['insts_max']}"
    step = case.get("loop_step")
    per_128 = str(round(loop["insts_min"] * 128 / step)) if step else ""
    loads = f"{loads['tma']}/{loads['cp_async']}/{loads['global']}"
    if loop.get("tma_reduces"):
        loads += f" +{loop['tma_reduces']} reduce"
    return [mma, str(loop["wgmma_waits"]), loads, str(loop["local"]), insts, per_128]


RULES = ("no_spill", "no_loop_spill", "no_serial", "wgmma")


def resource_table(cases: list[dict], results: list[dict]) -> str:
    """docs/generated/resources.md: a Markdown table per kernel family of what each case
    uses, with the compile time per family. Cases carry ``family``, ``variant``, ``tile`` and the
    rules that apply (`RULES`), optionally ``loop_step``; a list of the case names closes
    the page, so a test can tell when the page no longer matches the cases."""
    import triton

    lines = [
        "# Resources and machine code of every tuning config",
        "",
        "Generated by the resource gate (`tests/test_compile_gate.py`), not by hand: rerun",
        "`FUSEDPAR_WRITE_RESOURCES=1 pytest tests/test_compile_gate.py` after changing a",
        "kernel or a config list (it rewrites `docs/generated/resources.json`, the gate's",
        "cache, too).",
        f"Built with triton {triton.__version__} for sm_90 (H100) and sm_80 (A100); nothing",
        "ran on a GPU.",
        "",
        "Columns: registers per thread; spilled bytes per thread (the stack frame);",
        "shared memory in KiB (static + dynamic, limits 227 KiB on sm_90 and 163 KiB on",
        "sm_80); whether the PTX uses wgmma; ptxas's coded notes (C7515, C7511...: the",
        "wgmma were serialized, a wait after each). Then one iteration of the hot loop (the",
        "innermost loop with the most tensor-core instructions; `fusedpar.testing.machine_code`):",
        "its HGMMA (HMMA on sm_80) by shape; wgmma waits (`WARPGROUP.DEPBAR`); loads as",
        "TMA / cp.async / plain global (+ TMA reduce-adds into global memory, `UTMAREDG`);",
        "local-memory (spill) accesses; instructions per",
        "iteration, on the shortest path through the body (a masked block's extra code",
        "skipped) and the longest where they differ; for attention, instructions per 128",
        "keys (dK/dV: per 128 queries). Last, the CPU seconds the build took when it was",
        "built, and the rules the gate enforces beyond compiling within the shared-memory",
        "limit (`no spill`; `no loop spill`: none in the hot loop, what spills outside",
        "it reported; `no serial`: wgmma not serialized and no spill; `wgmma`; `report`:",
        "none).",
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
        lines.append(
            f"| {family} | {len(rows)} | {sum(times) / len(times):.1f}, "
            f"{max(times):.1f} | {sum(times):.0f} |"
        )
    for family, rows in families.items():
        lines += [
            "",
            f"## {family}",
            "",
            "| variant | tile (M x N, stages, warps) | sm | regs | spill B | shared KiB "
            "| wgmma | ptxas | HGMMA / iter | waits | loads | local | insts / iter "
            "| per 128 | CPU s | rule |",
            "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: | --- | ---: "
            "| ---: | ---: | ---: | --- |",
        ]
        for case, r in rows:
            rule = ", ".join(k.replace("_", " ") for k in RULES if case.get(k)) or "report"
            if not r["ok"]:
                lines.append(
                    f"| {case['variant']} | {case['tile']} | {case['cap']} | "
                    "failed to build |" + " |" * 13
                )
                continue
            cells = [
                case["variant"],
                case["tile"],
                str(case["cap"]),
                str(r["regs"]),
                str(r["spill"]),
                f"{r['shared'] / 1024:.1f}",
                "yes" if r["wgmma"] else "no",
                " ".join(r["notes"]) or "-",
                *_loop_columns(case, r),
                f"{r['cpu_seconds']:.1f}",
                rule,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    names = json.dumps(sorted(c["name"] for c in cases))
    return "\n".join(lines) + f"\n\n<!-- cases: {names} -->\n"


def _main() -> None:
    import multiprocessing
    import traceback

    request = json.load(sys.stdin)
    _worker_init(request["path"])
    cases, cache = request["cases"], request["cache"]
    results: list[dict | None] = [None] * len(cases)
    missing: dict[str, list[int]] = {}  # key: the cases that need this build
    for i, case in enumerate(cases):  # keys are cheap: the scenarios only record
        try:
            key = case_key(case)
        except Exception:
            results[i] = {
                "name": case["name"],
                "ok": False,
                "error": traceback.format_exc(),
                "seconds": 0.0,
                "cpu_seconds": 0.0,
                "cached": False,
            }
            continue
        if key in cache:
            results[i] = {**cache[key], "name": case["name"], "key": key, "cached": True}
        else:
            missing.setdefault(key, []).append(i)
    firsts = [cases[same[0]] for same in missing.values()]  # two cases, one build: once
    workers = max(1, min(request["workers"], len(firsts)))
    if workers == 1:
        built = [run_case(case) for case in firsts]
    else:
        # spawn, not fork: each worker imports triton itself; imap hands out one case at a
        # time, so a slow build (an fp32 FMA tile) does not hold back a fixed share.
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, _worker_init, (request["path"],)) as pool:
            built = list(pool.imap(run_case, firsts, chunksize=1))
    for same, result in zip(missing.values(), built, strict=True):
        for i in same:
            results[i] = {**result, "name": cases[i]["name"]}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()
