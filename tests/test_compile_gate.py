"""The compile and resource gate: every tuning config of every Triton kernel, built for
sm_90 (and sm_80 where a config must serve an A100) with no GPU present.

Each case records a launcher's real call on CPU tensors (see
`fusedpar.testing.compile_gate`), swaps in one tuning config and compiles it. A case
fails when

- it does not compile (what the interpreter forgives);
- its shared memory (static + dynamic) is over the device's: such a config is dead
  weight on every GPU run, so the config function prunes it by head dim and dtype;
- it spills in fp16/bf16 at head dim <= 128, or in any 16-bit GEMM: a silent slowdown;
- it is the largest tile of a matrix kernel and its sm_90 PTX does not use wgmma;
- it is the smallest config of a key built for sm_80 and does not fit an A100: the
  launchers' pruning always keeps that config, so every key has a candidate there (the
  tuner skips the larger ones that do not fit).

Everything else (registers, spills at D=256 and in fp32) is reported in
docs/generated/resources.md; ``FUSEDPAR_WRITE_RESOURCES=1 pytest tests/test_compile_gate.py``
rewrites it. Combinations left out, and why (each checked on a sample):

- fp16 GEMMs are built for every tile (conversions move their registers by a few);
  fp16 attention builds exactly as bf16 does, so only its largest tiles are built, and
  `test_fp16_matches_bf16` keeps checking both claims.
- Attention is built causal with a GQA group of 2, the heaviest specialisation measured
  (non-causal or MHA spill less: 128x128 forward, 0 B instead of 120 B; 64x64 dK/dV,
  16-128 B instead of 336 B), and in bf16 at D <= 128 with dK/dV's GQA split (every
  tile) and in the ring's modes (the largest tile: a forward step merging into fp32
  partials, gradients added into fp32 buffers; MHA and not causal, they use fewer
  registers than the causal GQA builds, e.g. 222 against 246 for the D=128 forward).
- On sm_80 only D=256 is built: shared memory grows with the head dim.
- fp32 attention is built at full precision (PyTorch's default, FMA dots: the slow and
  spilling builds) and, at D=256 only, in TF32 (the larger shared memory).
- The MoE kernels' expert flags (biases, the clamped SwiGLU) are built, every tile, in
  the two combinations a model uses: neither (the default) and both (gpt-oss), in the
  modes they change; the gate/up's mixed two (bias with silu, clamp without bias, each
  a part of gpt-oss's epilogue) at its largest tile only.
"""

import os
from pathlib import Path

import pytest
import torch
from fusedpar.kernels import common, matmul
from fusedpar.kernels.attention import plan as attn_plan

from fusedpar.testing import compile_gate as gate
from tests.attention import cases as attention_cases
from tests.elementwise import cases as elementwise_cases
from tests.linear_attention import cases as linear_attention_cases
from tests.linear_attention import conv_cases
from tests.matmul import cases as matmul_cases
from tests.moe import cases as moe_cases
from tests.support.gate import _smallest

RESOURCES_DOC = Path(__file__).resolve().parents[1] / "docs" / "generated" / "resources.md"
# The gate's cache: each build's results under its key (`compile_gate.build_key`).
RESOURCES_CACHE = RESOURCES_DOC.with_suffix(".json")


# --- cases: each family's, in the report's order -----------------------------------------

CASES: dict[str, dict] = {}
FAMILIES = (
    attention_cases,
    matmul_cases,
    moe_cases,
    elementwise_cases,
    linear_attention_cases,
    conv_cases,
)
for family in FAMILIES:
    assert not CASES.keys() & family.GATE_CASES.keys()
    CASES.update(family.GATE_CASES)
ATTENTION, HEAD_DIMS = attention_cases.ATTENTION, attention_cases.HEAD_DIMS
SOFTCAP_LOOP_RATIO = 1.3  # issue #42's bound
FUSED_K_LOOP_EXCESS = 0.05  # instructions a K step may take over matmul's


# --- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """Every case's result: from the cache where its build is unchanged, else built."""
    cases = list(CASES.values())
    results = gate.run_cases(cases, cache=gate.load_cache(RESOURCES_CACHE))
    return {c["name"]: r for c, r in zip(cases, results, strict=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_config_fits(built, name):
    case, result = CASES[name], built[name]
    assert result["ok"], result["error"]
    limit = gate.SHARED_LIMIT[case["cap"]]
    assert result["shared"] <= limit, (
        f"{result['shared']} B of shared memory, over sm_{case['cap']}'s {limit} B: prune this "
        f"tile in the config function (it is dead weight on every GPU run)"
    )
    if case["no_spill"]:
        assert result["spill"] == 0, f"spills {result['spill']} B ({result['regs']} registers)"
    loop = result["loop"] or {}
    if case.get("no_loop_spill"):
        assert loop.get("local", 0) == 0, f"{loop['local']} local accesses in the hot loop"
    if case["wgmma"]:
        assert result["wgmma"], "the sm_90 PTX should use wgmma (Hopper's warpgroup MMA)"
    if case["no_serial"] and result["wgmma"]:
        assert not result["serialized"], (
            f"ptxas serialized the wgmma ({', '.join(result['notes'])}): a wait after every "
            f"HGMMA, {result['loop'] and result['loop']['wgmma_waits']} per iteration of the "
            "hot loop"
        )
        if not case.get("no_loop_spill"):
            assert result["spill"] == 0, f"a tensor-core build spills {result['spill']} B"


def _twin(name):
    case = CASES[name]
    variant = case["variant"].replace("float16", "bfloat16", 1)
    same = ("family", "tile", "cap")
    return next(
        n
        for n, c in CASES.items()
        if c["variant"] == variant and all(c[k] == case[k] for k in same)
    )


@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if c["variant"].startswith("float16")]
)
def test_fp16_matches_bf16(built, name):
    """Why fp16 is built for only some tiles. Attention: fp16 builds exactly as bf16
    (registers, spills, shared memory: all 27 tiles at D <= 128 on triton 3.6 and 3.9),
    so its largest tile stands for the rest. GEMMs: the bias and output conversions move
    registers by a few (a 128x256 tile with bias: 181 in fp16, 170 in bf16 on triton
    3.6), so every tile is built in both; shared memory is always bf16's, which is why
    fp16 is not built at D=256 (where only shared memory is checked)."""
    usage = ("shared",) if CASES[name]["family"] == "matmul" else ("regs", "spill", "shared")
    assert {k: built[name][k] for k in usage} == {k: built[_twin(name)][k] for k in usage}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("label", ATTENTION)
def test_pruning_keeps_the_smallest_attention_tile(label, dtype):
    """The sm_80 cases build the smallest tile of each list: every sequence length's
    candidates must include it, so an A100 always has a config that fits."""
    for D in HEAD_DIMS:
        configs = ATTENTION[label][2](D, dtype, frozenset({"pointer"}))
        for n in (1, 16, 32, 64, 128, 1024):
            assert _smallest(configs) in attn_plan.prune_configs(configs, n, n)


def test_pruning_keeps_the_smallest_matmul_tile():
    for dtype in (torch.bfloat16, torch.float32):
        for accumulate in (False, True):
            configs = matmul.matmul_configs(dtype, accumulate)
            for m in (1, 16, 32, 256, 4096):
                assert _smallest(configs) in matmul._prune_configs(configs, m, m)


@pytest.mark.parametrize("variant", ["gather-qkv-bfloat16", "scatter-bfloat16"])
def test_fused_k_loop_is_the_plain_gemms(built, variant):
    """The fused GEMM's waits and counts stay out of its K loop: at every tile, the hot
    loop has matmul's HGMMA, wgmma waits and TMA loads, no local memory, and at most 5%
    more instructions. (triton 3.9 at 128x256: 77-83 against matmul's 105, the same 4
    HGMMA.64x256x16 and one wait: matmul's loop is flattened over tiles and carries
    their bookkeeping, ours is the K loop alone.)"""
    for name, case in CASES.items():
        if case["family"] != "matmul-fused" or case["variant"] != variant:
            continue
        plain = f"matmul-bfloat16-bias-{case['tile'].replace(' ', '-')}-sm90"
        ours, theirs = built[name]["loop"], built[plain]["loop"]
        assert ours["hgmma"] == theirs["hgmma"] and ours["wgmma_waits"] == theirs["wgmma_waits"]
        assert ours["loads"]["tma"] == theirs["loads"]["tma"] > 0 and ours["local"] == 0
        excess = ours["insts_min"] / theirs["insts_min"] - 1
        assert excess <= FUSED_K_LOOP_EXCESS, (name, ours["insts_min"], theirs["insts_min"])


def _macs_per_iteration(loop: dict, num_warps: int) -> int:
    """Multiply-adds one iteration of a hot loop issues: wgmma shapes (MxNxK) per
    warpgroup, mma.sync (16816: m16 n8 k16) per warp."""
    macs = 0
    for shape, count in loop["hgmma"].items():
        if shape == "16816":
            macs += 16 * 8 * 16 * count * num_warps
        else:
            m, n, k = map(int, shape.split("x"))
            macs += m * n * k * count * (num_warps // 4)
    return macs


def test_the_fused_backward_issues_five_gemms_per_block_pair(built):
    """Per (key block, query block) the fused backward's hot loop issues the tensor-core
    work of 5 GEMMs (S, dP, dV, dK, dQ), where the split backward's two kernels issue 7
    (dK/dV 4: S, dP, dV, dK; dQ 3: S, dP, dQ); at every 16-bit sm_90 wgmma tile, and with
    TMA reads dQ's share leaves through one TMA reduce-add per iteration. S, dK and dQ
    run over Q/K's head dim, dP and dV over V's, each padded to a power of two (MLA's 192:
    256). (Tiles without wgmma are left out: with 8 warps over 16 or 32 rows, warps
    repeat each other's mma.sync.)"""
    # (GEMMs over D, GEMMs over Dv)
    gemms = {"attention-fused": (3, 2), "attention-dkdv": (2, 2), "attention-dq": (2, 1)}
    checked = 0
    for name, case in CASES.items():
        if case["family"] not in gemms or not case["no_serial"] or not built[name]["wgmma"]:
            continue
        loop, config = built[name]["loop"], case["config"]
        D = common.next_power_of_2(case["params"]["head_dim"])
        Dv = common.next_power_of_2(case["params"].get("v_dim") or D)
        over_d, over_dv = gemms[case["family"]]
        macs = config["BLOCK_M"] * config["BLOCK_N"] * (over_d * D + over_dv * Dv)
        assert _macs_per_iteration(loop, config["num_warps"]) == macs, name
        if case["family"] == "attention-fused" and case["params"].get("tma", True):
            assert loop["tma_reduces"] == 1, name
        checked += 1
    assert checked > 60


def test_soft_capping_costs_at_most_a_third_more(built):
    """The soft-capped forward's hot loop (bf16: `tanh.approx.f32`, one MUFU.TANH and a
    multiply per score) stays within 1.3x of the plain forward's instructions per
    iteration at every tile both build. (triton 3.9, D=128 128x128: 1076 with the
    exact formula's exp2 and division, against 499 plain.)"""
    checked = 0
    for name, case in CASES.items():
        if case["family"] != "attention-fwd" or not case["variant"].startswith("window-softcap"):
            continue
        variant = case["variant"].removeprefix("window-softcap-")
        plain = next(
            (
                n
                for n, c in CASES.items()
                if c["family"] == "attention-fwd"
                and c["variant"] == variant
                and c["tile"] == case["tile"]
                and c["cap"] == case["cap"]
            ),
            None,
        )
        if plain is None:
            continue
        ratio = built[name]["loop"]["insts_min"] / built[plain]["loop"]["insts_min"]
        assert ratio <= SOFTCAP_LOOP_RATIO, (name, round(ratio, 2))
        checked += 1
    assert checked >= 4


def test_resource_table_is_current(built):
    """docs/generated/resources.md is the report of these results, and
    docs/generated/resources.json holds every build (so CI rebuilds nothing it need
    not). ``FUSEDPAR_WRITE_RESOURCES=1`` rewrites both (``=path``: writes the table
    there instead, e.g. to compare two triton versions)."""
    cases, results = list(CASES.values()), list(built.values())
    table = gate.resource_table(cases, results)
    target = os.environ.get("FUSEDPAR_WRITE_RESOURCES")
    if target == "1":
        RESOURCES_DOC.write_text(table)
        gate.save_cache(RESOURCES_CACHE, results)
    elif target:
        Path(target).write_text(table)
    stale = "stale: rerun with FUSEDPAR_WRITE_RESOURCES=1"
    rebuilt = sorted(r["name"] for r in results if not r["cached"] and target != "1")
    assert not rebuilt, f"docs/generated/resources.json is {stale} (built anew: {rebuilt[:5]})"
    assert RESOURCES_DOC.read_text() == table, f"docs/generated/resources.md is {stale}"
