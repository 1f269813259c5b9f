"""How `ParallelAttention`'s heads lie over the TP ranks: the KV heads each rank computes
with (Hkv / TP, or one, replicated on TP / Hkv ranks where TP is a multiple of Hkv), the
rows of the whole k and v parameters a rank then reads (`own_kv`), and the layout each
parameter is stored in (`head_layouts`: what the layer's ``param_layouts`` gives
`fusedpar.distribute`). docs/attention.md, "The layer"."""

from fusedpar.storage import ParamLayout


def kv_heads_per_rank(n_heads: int, n_kv_heads: int, tp: int) -> int:
    """The KV heads each TP rank computes with: Hkv / TP, or 1 where TP is a multiple of
    Hkv (each KV head replicated on TP / Hkv ranks: its query heads' ranks). ValueError
    for heads that do not split."""
    if n_heads % tp:
        raise ValueError(f"n_heads ({n_heads}) is not divisible by the TP degree ({tp})")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(
            f"n_kv_heads ({n_kv_heads}) and the TP degree ({tp}): one must divide the "
            "other (KV heads split over TP, or each replicated on TP / n_kv_heads ranks)"
        )
    return max(1, n_kv_heads // tp)


def own_kv(tensors, head_dim: int, tp_rank: int, replicas: int) -> list:
    """k's and v's weights (or biases, or a "full" k norm's weight) a TP rank computes
    with: the tensors themselves, or with KV heads replicated on `replicas` ranks each,
    its own KV head's rows (a view) of them whole. None stays None."""
    if replicas == 1 or tensors[0] is None:
        return list(tensors)
    head = tp_rank // replicas
    return [t[head * head_dim : (head + 1) * head_dim] for t in tensors]


def head_layouts(tp_group, qk_norm: str | None, replicas: int) -> dict:
    """For `fusedpar.distribute`: the heads (and their biases, gates, "full" norm
    weights and sinks) split over the TP group; the o bias whole, summed over TP
    inside the layer; "head" norm weights whole, each TP rank's gradient a partial
    sum over its own heads; replicated KV heads (`replicas` > 1) likewise whole, each
    rank's gradient its own KV head's rows from its own query heads (zero elsewhere),
    summed over TP (a "full" k norm's weight with them): a checkpoint holds every KV
    head once, loadable at any TP."""
    heads, o, tp = ParamLayout(0, tp_group), ParamLayout(1, tp_group), (tp_group,)
    norm = heads if qk_norm == "full" else ParamLayout(partial_over=tp)
    kv = ParamLayout(partial_over=tp) if replicas > 1 else heads
    k_norm = kv if qk_norm == "full" else norm  # "full": per KV head, as k
    return {
        "q_weight": heads,
        "k_weight": kv,
        "v_weight": kv,
        "o_weight": o,
        "q_bias": heads,
        "k_bias": kv,
        "v_bias": kv,
        "gate_weight": heads,
        "gate_bias": heads,
        "o_bias": ParamLayout(complete_over=tp),
        "q_norm_weight": norm,
        "k_norm_weight": k_norm,
        "sinks": heads,
    }
