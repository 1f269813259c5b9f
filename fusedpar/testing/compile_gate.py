"""The compile gate: build Triton kernels for real GPUs on a machine that has none.

The interpreter forgives what the GPU compiler rejects (non-power-of-2 ``arange``, dot
tiles under 16, unsupported ops). This compiles a ``@triton.jit`` kernel to PTX and cubin
for a given compute capability through ``triton.compile(ASTSource(...), target=...)``.

It must run where ``TRITON_INTERPRET`` is unset (the interpreter replaces the jit object
at decoration time), so `compile_in_subprocess` runs the cases in a fresh interpreter.

A case is a dict::

    {"kernel": "fusedpar.kernels.matmul:_matmul_kernel",   # module:attribute
     "signature": {"a_ptr": "*bf16", "M": "i32", ...},     # every non-constexpr argument
     "constexprs": {"BLOCK_M": 128, ...},                 # every constexpr argument
     "cap": 90, "num_warps": 8, "num_stages": 3}
"""

import importlib
import json
import os
import subprocess
import sys


def compile_case(case: dict) -> dict:
    """Compile one case in this process. Returns ptx, shared memory and register use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, attr = case["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), attr)
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("the compile gate cannot run with TRITON_INTERPRET=1")
    constexprs = case.get("constexprs", {})
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in case["signature"]:
            signature[name] = case["signature"][name]
        else:
            raise ValueError(f"{case['kernel']}: argument {name!r} has no type in the case")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": case.get("num_warps", 4), "num_stages": case.get("num_stages", 3)}
    compiled = triton.compile(src, target=GPUTarget("cuda", case["cap"], 32), options=options)
    return {
        "ptx": compiled.asm["ptx"],
        "cubin_bytes": len(compiled.asm["cubin"]),
        "shared": compiled.metadata.shared,
    }


def compile_in_subprocess(cases: list[dict], timeout: float = 600) -> list[dict]:
    """Compile every case in one fresh process without the interpreter.

    Returns one dict per case: ``ok``, ``error`` (the traceback text when not ok),
    ``wgmma`` (whether the PTX uses Hopper's warpgroup MMA), ``shared`` (bytes).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "fusedpar.testing.compile_gate"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compile gate process failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def _main() -> None:
    import traceback

    results = []
    for case in json.load(sys.stdin):
        try:
            out = compile_case(case)
            results.append(
                {"ok": True, "wgmma": "wgmma" in out["ptx"], "shared": out["shared"], "error": ""}
            )
        except Exception:
            results.append(
                {"ok": False, "wgmma": False, "shared": 0, "error": traceback.format_exc()}
            )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()
