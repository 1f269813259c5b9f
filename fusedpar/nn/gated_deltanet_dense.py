"""The three checkpoint layouts of a Gated DeltaNet layer, read into `GatedDeltaNet`'s
sections by index maps: which rows of which dense tensor each section's heads are.

| layout        | q, k, v rows                         | z          | b, a          | out      |
| ------------- | ------------------------------------ | ---------- | ------------- | -------- |
| `qwen3_next`  | `in_proj_qkvz`, per k-head           | (the same) | `in_proj_ba`, | out_proj |
|               | [q_g K | k_g K | v_g rV | z_g rV]    |            | per k-head    |          |
| `qwen3_5`     | `in_proj_qkv`: all q, all k, all v   | in_proj_z  | in_proj_b/a   | out_proj |
| `olmo_hybrid` | `q_proj`, `k_proj`, `v_proj`         | g_proj     | b_proj/a_proj | o_proj   |

r = Hv / Hk. The conv weight is section-contiguous (q | k | v) in all three. A map
covers every row of its dense tensor exactly once (`check_partition`), and a rank's
rows are its heads' rows within one section (`rank_rows`): no split mixes sections.
"""

import torch
from torch import nn

# Our sections, each head-major: (name, per-head width key, head count key)
SECTIONS = ("q", "k", "v", "z", "b", "a")


def detect_layout(module: nn.Module) -> str:
    """The layout of a Hugging Face GDN module, read off its projections' names."""
    if hasattr(module, "in_proj_qkvz"):
        return "qwen3_next"
    if hasattr(module, "in_proj_qkv"):
        return "qwen3_5"
    if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "g_proj")):
        return "olmo_hybrid"
    raise ValueError(
        f"GatedDeltaNet.from_dense: {type(module).__name__} has none of the projections "
        f"of the layouts qwen3_next (in_proj_qkvz), qwen3_5 (in_proj_qkv), olmo_hybrid "
        f"(q/k/v/g_proj)"
    )


def index_maps(layout: str, Hk: int, Hv: int, K: int, V: int) -> dict:
    """section -> (dense tensor's name, row indices (int64), in our head-major order)."""
    r = Hv // Hk
    heads = torch.arange(Hk)[:, None]  # (Hk, 1)
    if layout == "qwen3_next":
        stride, ba = 2 * K + 2 * r * V, 2 * r

        def grouped(offset, width, step):  # each k-group's block, groups in order
            return (heads * step + offset + torch.arange(width)).reshape(-1)

        return {
            "q": ("in_proj_qkvz", grouped(0, K, stride)),
            "k": ("in_proj_qkvz", grouped(K, K, stride)),
            "v": ("in_proj_qkvz", grouped(2 * K, r * V, stride)),
            "z": ("in_proj_qkvz", grouped(2 * K + r * V, r * V, stride)),
            "b": ("in_proj_ba", grouped(0, r, ba)),
            "a": ("in_proj_ba", grouped(r, r, ba)),
        }
    if layout == "qwen3_5":
        qk = Hk * K
        return {
            "q": ("in_proj_qkv", torch.arange(qk)),
            "k": ("in_proj_qkv", torch.arange(qk, 2 * qk)),
            "v": ("in_proj_qkv", torch.arange(2 * qk, 2 * qk + Hv * V)),
            "z": ("in_proj_z", torch.arange(Hv * V)),
            "b": ("in_proj_b", torch.arange(Hv)),
            "a": ("in_proj_a", torch.arange(Hv)),
        }
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "z": "g_proj", "b": "b_proj"}
    widths = {"q": Hk * K, "k": Hk * K, "v": Hv * V, "z": Hv * V, "b": Hv, "a": Hv}
    return {s: (names.get(s, "a_proj"), torch.arange(widths[s])) for s in SECTIONS}


def conv_rows(Hk: int, Hv: int, K: int, V: int) -> dict:
    """section -> rows of the dense conv weight (q | k | v, every layout)."""
    qk = Hk * K
    return {
        "q": torch.arange(qk),
        "k": torch.arange(qk, 2 * qk),
        "v": torch.arange(2 * qk, 2 * qk + Hv * V),
    }


def check_partition(maps: dict, sizes: dict) -> None:
    """Raise unless the maps cover each dense tensor's `sizes[name]` rows once each."""
    for name, total in sizes.items():
        rows = torch.cat([idx for tensor, idx in maps.values() if tensor == name])
        if not torch.equal(rows.sort().values, torch.arange(total)):
            raise ValueError(
                f"GatedDeltaNet: the index maps of {name} do not cover its {total} rows "
                f"once each (a layout mixing sections)"
            )


def rank_rows(rows: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's rows of a head-major section: its contiguous block of heads."""
    if rows.numel() % tp:
        raise ValueError(f"GatedDeltaNet: a section of {rows.numel()} rows over TP {tp}")
    return rows.chunk(tp)[rank]


def linear_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The weight of the dense ``nn.Linear`` `name`, refused if it has a bias."""
    linear = getattr(module, name)
    if getattr(linear, "bias", None) is not None:
        raise ValueError(f"GatedDeltaNet.from_dense: {name} has a bias; no family has one")
    return linear.weight


def dense_parts(module: nn.Module, layout: str, sizes: tuple) -> dict:
    """Our full (unsplit) tensors of a dense module: q, k, v, z, b, a weights (rows,
    d), conv_q/k/v (rows, W), A_log, dt_bias (Hv,), norm (V,), o (d, Hv V)."""
    Hk, Hv, K, V = sizes
    maps = index_maps(layout, Hk, Hv, K, V)
    dense = {name: linear_weight(module, name) for name, _ in maps.values()}
    check_partition(maps, {name: w.shape[0] for name, w in dense.items()})
    parts = {s: dense[name][rows] for s, (name, rows) in maps.items()}
    conv = module.conv1d
    if conv.bias is not None:
        raise ValueError("GatedDeltaNet.from_dense: conv1d has a bias; no family has one")
    conv_weight = conv.weight.squeeze(1)  # (C, W)
    for s, rows in conv_rows(Hk, Hv, K, V).items():
        parts[f"conv_{s}"] = conv_weight[rows]
    norm = module.o_norm if layout == "olmo_hybrid" else module.norm
    out = "o_proj" if layout == "olmo_hybrid" else "out_proj"
    parts.update(
        A_log=module.A_log, dt_bias=module.dt_bias, norm=norm.weight, o=linear_weight(module, out)
    )
    return parts
