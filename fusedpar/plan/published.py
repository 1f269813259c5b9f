"""Published training throughput, each with the layout it ran, and the planner's estimate
of it: the time model's check (docs/plan.md lists the sources; tests/plan/test_plan_time.py
holds every point within ±20% or to its stated reason). A point counts as reproduced
when the estimate is within ±20% and fusedpar would fit in the point's memory at that
layout (the planner's own verdict, `Estimate.fits`); one it says would not fit is
reported as such, whatever its throughput.

Each point is bf16 (no FP8 point: the planner models bf16 GEMMs). The sources' metric is
turned into tokens/s per GPU where they publish another (Megatron's TFLOP/s and MFU,
Korthikanti's iteration times) by their own FLOP formulas. Their hardware is modelled as
published: torchtitan's H100s of 2024 are 500 W parts with HBM2e (2.4 TB/s), whose dense
peak (between the SXM's 989 and the NVL's 835 TFLOP/s, in their words) is taken as the
middle, 912. DeepSeek-V3's layout (PP16 x EP64 over dp ranks, FP8) is a case of its
own (`deepseek_v3`): its memory and rank, not its throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fusedpar.parallel import ParallelDims
from fusedpar.plan.accounting import POLICIES
from fusedpar.plan.devices import DEVICES, Device
from fusedpar.plan.estimate import estimate
from fusedpar.plan.model import PRESETS, ModelSpec

TITAN_H100 = Device("H100 500 W HBM2e (torchtitan 2024)", 912, 96, 2.4, 450, 50)


def _gpt(name, d, layers, heads, vocab) -> ModelSpec:
    """A GPT of Megatron's tables: MHA, a 4d GELU MLP (2 matrices: `gated=False`)."""
    return ModelSpec(name, vocab, d, layers, heads, heads, d // heads, 4 * d, gated=False)


LLAMA2_13B = ModelSpec("Llama-2 13B", 32000, 5120, 40, 40, 40, 128, 13824)


@dataclass(frozen=True)
class Point:
    key: str
    source: str  # where it is published (docs/plan.md has the full citation)
    model: ModelSpec
    device: Device
    dims: ParallelDims
    seq_len: int
    micro_batch: int
    microbatches: int
    checkpointing: str
    tokens_per_s_per_gpu: float  # published (or from the published metric, see `derived`)
    schedule: str | None = None
    stages_per_rank: int = 2
    derived: str = ""  # how the published metric became tokens/s per GPU
    scale: float = 1.0  # estimated at another depth fusedpar's pipeline takes: times this
    options: dict = field(default_factory=dict)
    memory_gib: float | None = None  # the memory the source reports (torchtitan's reading)


H100, A100 = DEVICES["h100"], DEVICES["a100"]
# The stacks as published: torchtitan without torch.compile runs PyTorch's element-wise ops
# eagerly (EAGER passes, fitted on these points: docs/plan.md), TP's collectives unhidden
# before AsyncTP; Megatron (2022) had no TP overlap yet; Megatron's distributed optimizer
# and Llama 3's "no reshard after forward" gather parameters once a step.
EAGER = {"elementwise_passes": 12.0}
TITAN_TP = {**EAGER, "overlap": "serial"}
MEGATRON = {"dp_sharding": "zero1"}
MEGATRON_2022 = {"overlap": "serial"}
POINTS = [
    Point(
        "torchtitan-8b-8",
        "torchtitan benchmarks/llama3_h100_202412 Table 1 (bf16 eager)",
        PRESETS["llama3-8b"],
        TITAN_H100,
        ParallelDims(dp=8),
        8192,
        2,
        1,
        "selective",
        5762,
        options=EAGER,
        memory_gib=82.4,
    ),
    Point(
        "torchtitan-8b-128",
        "torchtitan benchmarks/llama3_h100_202412 Table 3 (bf16 eager)",
        PRESETS["llama3-8b"],
        TITAN_H100,
        ParallelDims(dp=128),
        8192,
        2,
        1,
        "selective",
        5605,
        options=EAGER,
        memory_gib=67.0,
    ),
    Point(
        "torchtitan-8b-a100",
        "torchtitan docs/performance.md @4d88a8a (A100, op SAC)",
        PRESETS["llama3-8b"],
        A100,
        ParallelDims(dp=64),
        8192,
        1,
        1,
        "selective",
        2973,
        options=EAGER,
    ),
    Point(
        "torchtitan-70b-a100",
        "torchtitan docs/performance.md @4d88a8a (A100, full AC)",
        PRESETS["llama3-70b"],
        A100,
        ParallelDims(dp=64),
        8192,
        1,
        1,
        "full",
        331,
        options=EAGER,
    ),
    Point(
        "torchtitan-13b-a100",
        "torchtitan docs/performance.md @3faaa1a (Llama 2 13B)",
        LLAMA2_13B,
        A100,
        ParallelDims(dp=64),
        4096,
        2,
        1,
        "none",
        2162,
        options=EAGER,
    ),
    Point(
        "torchtitan-405b-128",
        "torchtitan docs/performance.md @4d88a8a (405B, full AC)",
        PRESETS["llama3-405b"],
        TITAN_H100,
        ParallelDims(dp=16, tp=8),
        8192,
        2,
        1,
        "full",
        109,
        options=TITAN_TP,
    ),
    Point(
        "megatron-7b",
        "Megatron-LM README scaling table (H100), 7.1B",
        _gpt("GPT 7.1B", 4096, 30, 32, 131072),
        H100,
        ParallelDims(dp=48, tp=2),
        4096,
        1,
        4,
        "selective",
        10240,
        derived="465.9 TFLOP/s by Megatron's FLOP formula",
        options=MEGATRON,
    ),
    Point(
        "megatron-70b",
        "Megatron-LM README scaling table (H100), 70B",
        _gpt("GPT 70B", 8192, 84, 64, 131072),
        H100,
        ParallelDims(dp=48, tp=8, pp=2),
        4096,
        1,
        8,
        "selective",
        941,
        schedule="1F1B",
        derived="419.7 TFLOP/s by Megatron's FLOP formula",
        options=MEGATRON,
    ),
    Point(
        "megatron-314b",
        "Megatron-LM README scaling table (H100), 314B",
        _gpt("GPT 314B", 16384, 96, 128, 131072),
        H100,
        ParallelDims(dp=48, tp=8, pp=8),
        4096,
        1,
        32,
        "selective",
        244,
        schedule="Interleaved1F1B",
        derived="474.4 TFLOP/s by Megatron's FLOP formula",
        options=MEGATRON,
    ),
    Point(
        "korthikanti-22b",
        "Korthikanti et al. 2022, Table 5 (A100, SP + selective)",
        _gpt("GPT 22B", 6144, 48, 64, 51200),
        A100,
        ParallelDims(tp=8),
        2048,
        4,
        1,
        "selective",
        931,
        derived="iteration 1.10 s, 4 x 2048 tokens on 8 GPUs",
        options=MEGATRON_2022,
    ),
    Point(
        "korthikanti-175b",
        "Korthikanti et al. 2022, Table 5 (A100, SP + selective)",
        _gpt("GPT 175B", 12288, 96, 96, 51200),
        A100,
        ParallelDims(tp=8, pp=8),
        2048,
        1,
        64,
        "selective",
        149,
        schedule="Interleaved1F1B",
        stages_per_rank=3,
        derived="iteration 13.75 s, 64 x 2048 tokens on 64 GPUs",
        options=MEGATRON_2022,
    ),
    Point(
        "korthikanti-175b-full",
        "Korthikanti et al. 2022, Table 5 (A100, full recompute)",
        _gpt("GPT 175B", 12288, 96, 96, 51200),
        A100,
        ParallelDims(tp=8, pp=8),
        2048,
        1,
        64,
        "full",
        113,
        schedule="Interleaved1F1B",
        stages_per_rank=3,
        derived="iteration 18.13 s, 64 x 2048 tokens on 64 GPUs",
        options=MEGATRON_2022,
    ),
    Point(
        "llama3-405b-8k",
        "Llama 3 paper, Table 4 (8,192 H100)",
        ModelSpec("Llama-3 405B at 128 layers", 128256, 16384, 128, 128, 8, 128, 53248),
        H100,
        ParallelDims(dp=64, tp=8, pp=16),
        8192,
        1,
        32,
        "none",
        163,
        schedule="Interleaved1F1B",
        scale=128 / 126,
        derived="430 TFLOP/s, 43% MFU, by 6N + attention (PaLM's)",
        options=MEGATRON,
    ),
]


# DeepSeek-V3's published layout (its technical report, section 3): 2,048 H800s, PP 16 x
# EP 64 over the data-parallel ranks x ZeRO-1 DP (dp 128: the experts' optimizer state
# sharded over the 2 dp ranks outside each EP group), no TP, sequences of 4,096, DualPipe,
# 15,360 sequences a step. Its 61 layers take no equal stages: estimated at 64 (3 dense
# + 61 MoE), two a stage of DualPipeV's 32, throughput scaled by 64/61. FP8 GEMMs and a
# campaign average (1,543 tokens/s per GPU: 14.8T tokens in 2.664M GPU hours), not a bf16
# step rate: what the case holds is the layout, fitting in the H800's memory, and its rank
# among the layouts the planner could express before (EP over cp, ulysses and tp only).
DEEPSEEK_V3 = replace(PRESETS["deepseek-v3"], name="DeepSeek-V3 at 64 layers", n_layers=64)
DEEPSEEK_V3_LAYOUT = ParallelDims(pp=16, dp=128, ep="dp", ep_degree=64)
DEEPSEEK_V3_SEQUENCES = 15360
DEEPSEEK_V3_SCALE = 64 / 61


def deepseek_v3(dims: ParallelDims = DEEPSEEK_V3_LAYOUT, **options):
    """DeepSeek-V3 (`DEEPSEEK_V3`, 4,096 tokens a sequence, the published batch) at `dims`
    on H800s: FSDP2's zero1 (the published ZeRO-1), DualPipeV under pp, one sequence a
    microbatch, the cheapest checkpointing policy that fits (the last tried if none
    does). `options` go to `estimate`."""
    for policy in POLICIES:
        est = estimate(
            DEEPSEEK_V3,
            dims,
            seq_len=4096,
            micro_batch=1,
            microbatches=DEEPSEEK_V3_SEQUENCES // dims.dp,
            schedule="DualPipeV" if dims.pp > 1 else None,
            device="h800",
            dp_sharding="zero1",
            checkpointing=policy,
            **options,
        )
        if est.fits:
            break
    return est


TOLERANCE = (0.8, 1.2)  # the estimate over the published tokens/s


def reproduce(points=POINTS) -> list[dict]:
    """Each point: published and estimated tokens/s per GPU and their ratio, the peak the
    planner puts on a rank, whether it fits the point's GPUs (`fits`), and `reproduced`:
    it fits and the ratio is within `TOLERANCE`."""
    rows = []
    for p in points:
        est = estimate(
            p.model,
            p.dims,
            seq_len=p.seq_len,
            micro_batch=p.micro_batch,
            microbatches=p.microbatches,
            schedule=p.schedule,
            device=p.device,
            checkpointing=p.checkpointing,
            stages_per_rank=p.stages_per_rank,
            **p.options,
        )
        got = est.tokens_per_s_per_gpu * p.scale
        ratio = got / p.tokens_per_s_per_gpu
        rows.append(
            {
                "point": p.key,
                "source": p.source,
                "layout": est.layout(),
                "published": p.tokens_per_s_per_gpu,
                "estimated": got,
                "ratio": ratio,
                "mfu": est.mfu,
                "peak_gb": est.memory["peak"] / 1e9,
                "memory_gb": p.device.memory_gb,
                "published_memory_gib": p.memory_gib,
                "fits": est.fits,
                "reproduced": est.fits and TOLERANCE[0] <= ratio <= TOLERANCE[1],
                "notes": est.notes,
            }
        )
    return rows
