"""How a model converted by `fusedpar.integrations.hf.parallelize` takes its batch: the
forward pre-hook that refuses what the converted model would get wrong and keeps this
rank's share (``batch="full"``) or checks the caller's (``batch="local"``), the forward
hook that adds the loss over the whole sequence, and the sharding helpers users call
(`local_tokens`, `full_logits`, `next_token_labels`). The table of the two batch modes
is `fusedpar.integrations.hf`'s module doc.

Every check of a first call ends in the same ValueError on every rank
(`fusedpar.checks.Verdict`): a rank's own checks run first, their verdicts travel in
the one gather that compares the ranks' batches.
"""

import math

import torch
import torch.nn.functional as F

from fusedpar import checks, comm
from fusedpar.axes import mesh_axes_of
from fusedpar.integrations import hf_heads as heads
from fusedpar.kernels.common import accumulator
from fusedpar.ops.sequence import gather_sequence, shard_sequence

BATCHES = ("full", "local")
SEQUENCE_AXES = ("cp", "ulysses", "tp")  # the mesh axes a sequence is sharded over, in order


class Batch:
    """How a converted model takes its batch, and the labels of the call in flight."""

    def __init__(self, kind: str, mesh, groups: dict, forward_args: list, head="causal"):
        self.kind, self.mesh, self.groups, self.head = kind, mesh, groups, head
        self.forward_args = forward_args  # the model's forward, positionally
        self.pending: list = []  # (local labels (shifted: causal), num_items_in_batch) per call
        self.cu_seqlens: torch.Tensor | None = None  # the call's packed documents (int32)
        # sequence classification: each row's pooled position, this rank's tokens' positions
        self.pad_token_id = None
        self.pooled: torch.Tensor | None = None  # (B,) int64
        self.token_positions: torch.Tensor | None = None  # (1, S_loc) int64
        # (fixed: read as plain ints where torch.compile traces the hooks)
        self.sequence_ranks = math.prod(comm.group_size(groups.get(a)) for a in SEQUENCE_AXES)
        self.gathers = mesh is not None and mesh.size() > 1  # the first call's batch check

    def ranks(self) -> int:
        """The ranks that share one sequence: cp x ulysses x tp."""
        return self.sequence_ranks


def take_batch(module, args, kwargs):
    """Forward pre-hook: refuse what the converted model would get wrong; under "full",
    check the ranks got the same batch and keep this rank's share of it. This rank's
    checks run first, into a `checks.Verdict` gathered with the batch's fingerprints at
    the first call: a refusal is the same ValueError on every rank."""
    state = module._fusedpar_batch
    state.cu_seqlens = None
    kwargs = {**dict(zip(state.forward_args, args, strict=False)), **kwargs}
    verdict = checks.Verdict()
    if state.kind == "local":
        tokens = verdict.run(_read_local, kwargs, state)
        _check_local(tokens, state, verdict)
        kwargs["position_ids"] = global_positions(tokens.shape[1] * state.ranks(), tokens, state)
        state.pending.append(None)
        return (), kwargs
    taken = verdict.run(_read_full, kwargs, state)
    check_same_batch(taken, state, verdict)
    tokens, shifted, positions = taken["tokens"], taken["labels"], taken["position_ids"]
    seq = tokens.shape[1]
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            kwargs[name] = local_tokens(kwargs[name], state.groups)
    state.token_positions = global_positions(seq, tokens, state)
    if state.cu_seqlens is None:
        kwargs["position_ids"] = state.token_positions
    else:  # positions restart in each document (learned positions are looked up there)
        kwargs["position_ids"] = local_tokens(positions.expand(1, seq), state.groups)
    local = None if shifted is None else local_tokens(shifted, state.groups)
    # Hugging Face's classifiers take the mean, whatever num_items_in_batch says
    items = kwargs.pop("num_items_in_batch", None) if state.head == "causal" else None
    kwargs.pop("num_items_in_batch", None)
    state.pending.append((local, items) if local is not None else None)
    return (), kwargs


BATCH_TENSORS = ("tokens", "labels", "position_ids", "attention_mask", "sequence labels")


BATCH_ARGUMENTS = (  # the tensors a call may pass, checked for their type first
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "labels",
    "shift_labels",
)


def check_tensors(kwargs, names=BATCH_ARGUMENTS) -> None:
    """TypeError unless each of `names` in `kwargs` is a tensor or None: the checks after
    read their shapes (an AttributeError there would escape the `checks.Verdict` and
    leave the other ranks waiting in its gather)."""
    for name in names:
        given = kwargs.get(name)
        if given is not None and not isinstance(given, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(given).__name__}")


def _read_call(kwargs) -> torch.Tensor:
    """The checks of a call under either batch mode; returns its input_ids or
    inputs_embeds."""
    check_tensors(kwargs)
    if kwargs.get("use_cache"):
        raise ValueError("a model converted by fusedpar keeps no KV cache: use_cache=False")
    if kwargs.get("past_key_values") is not None:
        raise ValueError("a model converted by fusedpar keeps no KV cache: no past_key_values")
    if kwargs.get("logits_to_keep", 0) not in (0, None):
        raise ValueError("logits_to_keep: a converted model's logits are this rank's tokens")
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    if tokens is None or tokens.dim() < 2:
        raise ValueError("a converted model takes input_ids (B, S) or inputs_embeds (B, S, d)")
    if kwargs.get("token_type_ids") is not None:
        raise ValueError("token_type_ids are not sharded by a converted model: leave them out")
    return tokens


def _read_full(kwargs, state) -> dict:
    """batch="full": this rank's checks of the call (`kwargs`: its mask, positions and
    labels popped, the model's own kwargs left); returns {`BATCH_TENSORS` name: tensor or
    None}, the labels shifted (a causal LM's), as every rank of a cp x tp group must
    hold them. Sets the state's packed documents and pooled positions."""
    tokens = _read_call(kwargs)
    seq = tokens.shape[1]
    check_shards(seq, state.groups)
    mask, positions = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    if torch.compiler.is_compiling():  # no host read in a graph: asserted inside it
        _assert_whole(mask, positions, tokens.shape[:2])
        mask = positions = None
    if positions is not None:
        state.cu_seqlens = packed_documents(positions, tokens.shape[:2])
    # sequence classification: Hugging Face's own loss of the pooled logits takes labels
    pooled_labels = kwargs.get("labels") if state.head == "sequence" else None
    labels = None if state.head == "sequence" else kwargs.pop("labels", None)
    shifted = kwargs.pop("shift_labels", None)
    if shifted is not None and state.head != "causal":
        raise ValueError("shift_labels are a causal LM's: pass labels")
    if labels is not None and shifted is not None:
        raise ValueError("pass labels or shift_labels, not both")
    given = labels if labels is not None else shifted
    if given is not None and tuple(given.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"labels must be (B, S) = {tuple(tokens.shape[:2])}, like the input, "
            f"got {tuple(given.shape)}"
        )
    if labels is not None:  # Hugging Face shifts inside a causal LM: over the whole sequence
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100) if state.head == "causal" else labels
    if pooled_labels is not None and (
        pooled_labels.dim() == 0 or pooled_labels.shape[0] != tokens.shape[0]
    ):
        raise ValueError(
            f"sequence classification labels must be one per row, (B,) or "
            f"(B, num_labels) with B = {tokens.shape[0]}, got {tuple(pooled_labels.shape)}"
        )
    if state.head == "sequence":
        state.pooled = heads.pooled_positions(kwargs.get("input_ids"), tokens, state.pad_token_id)
    if mask is not None:
        pooled = state.pooled if state.head == "sequence" else None
        packed = state.cu_seqlens is not None
        heads.check_padding(
            mask, tokens.shape[:2], state.head, labels=shifted, pooled=pooled, packed=packed
        )
    given = (tokens, shifted, positions, mask, pooled_labels)
    return dict(zip(BATCH_TENSORS, given, strict=True))


def _assert_whole(mask, positions, shape) -> None:
    """While torch.compile traces: the mask and positions a compiled call takes, those of
    whole sequences (a tokenizer's all-ones mask, position_ids 0..S-1), asserted inside
    the graph (a RuntimeError when it runs otherwise), as reading them on the host (the
    eager checks) would break the graph: padding and packed documents need eager calls."""
    batch, seq = shape
    if mask is not None:
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(
                f"attention_mask must be (B, S) = {(batch, seq)}, got {tuple(mask.shape)}"
            )
        torch._assert_async(
            (mask == 1).all(),
            "a compiled model converted by fusedpar "
            "takes no padding: attention_mask all ones, or left out",
        )
    if positions is not None:
        if positions.shape[-1] != seq or positions.dim() > 2:
            raise ValueError(
                f"position_ids must be (B, S) = {(batch, seq)}, got {tuple(positions.shape)}"
            )
        whole = (positions == torch.arange(seq, device=positions.device)).all()
        torch._assert_async(
            whole,
            "a compiled model converted by fusedpar takes "
            "position_ids 0..S-1, or none: packed documents need eager calls",
        )


def check_same_batch(taken: dict | None, state, verdict) -> None:
    """The same ValueError on every rank unless every rank passed its checks (`verdict`)
    and the ranks of each cp x tp group (all but dp) hold equal tensors (`taken`, None
    where this rank refused): one all-gather of the verdicts and the tensors' shapes and
    fingerprints over the stage's mesh, at the first call (every call under
    FUSEDPAR_CHECKS=all, `fusedpar.checks`), where the mesh has more than one rank (dp
    alone too: a refusal stops every rank); otherwise this rank's refusal, alone."""
    given = [t for t in (taken or {}).values() if t is not None]
    if not state.gathers or not checks.due(state, *given):
        verdict.reraise()
        return
    fields = {name: checks.Content((taken or {}).get(name)) for name in BATCH_TENSORS}
    hint = (
        "The ranks of a cp x tp group got different batches: each takes the whole batch, "
        "the same on every rank of its group (the model shards it), or parallelize with "
        "batch='local' and pass local_tokens(input_ids, groups)"
    )
    checks.agree_on_mesh(
        "batch='full'", state.mesh, fields, verdict, apart=_dp_axis(state), hint=hint
    )
    checks.passed(state)


def packed_documents(positions: torch.Tensor, shape) -> torch.Tensor | None:
    """The documents of a packed batch, as Hugging Face's packing collators give them
    (``DataCollatorWithFlattening``): position_ids (1, S) that restart at 0 at each
    document's start and rise by 1 within it. Returns cu_seqlens (int32; None for one
    whole sequence, ``0..S-1``), for a batch of `shape` (B, S). Anything else (offsets,
    padding) raises."""
    batch, seq = shape
    if positions.dim() not in (1, 2) or positions.shape[-1] != seq:
        raise ValueError(
            f"position_ids must be (B, S) = {(batch, seq)}, got {tuple(positions.shape)}"
        )
    expected = torch.arange(seq, device=positions.device)
    positions = positions.reshape(-1, seq)
    if bool((positions == expected).all()):
        return None
    starts = positions == 0
    rises = positions[:, 1:] == positions[:, :-1] + 1
    if not bool(starts[:, 0].all()) or not bool((rises | starts[:, 1:]).all()):
        raise ValueError(
            "position_ids must be 0..S-1, or restart at 0 at each packed "
            "document's start and rise by 1 within it (no offsets, no "
            "padding)"
        )
    if positions.shape[0] != 1 or batch != 1:
        raise ValueError(
            "packed documents (position_ids that restart) take one sequence "
            f"(B = 1), as Hugging Face's flattening collator makes; got B = "
            f"{batch}"
        )
    p = positions[0]
    bounds = torch.cat([starts[0].nonzero().flatten(), p.new_tensor([seq])])
    return bounds.to(torch.int32)


def global_positions(full_len: int, tokens, state) -> torch.Tensor:
    """(1, S_loc): the global positions of this rank's tokens of a `full_len` sequence,
    given to the model as its position_ids: learned absolute positions (GPT-2) are
    looked up there; fusedpar's attention applies RoPE itself."""
    positions = torch.arange(full_len, device=tokens.device)[None]
    return local_tokens(positions, state.groups)


def _read_local(kwargs, state) -> torch.Tensor:
    """batch="local": this rank's checks of the call: what only the caller can shard is
    refused, and its share must make a whole sequence that splits into the shards.
    Returns the tokens."""
    tokens = _read_call(kwargs)
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "a model converted by fusedpar is causal over whole sequences: "
            "pass attention_mask=None (batch='local')"
        )
    if kwargs.get("position_ids") is not None:
        raise ValueError(
            "a converted model takes no position_ids: RoPE is applied at the "
            "global positions of the local tokens"
        )
    if kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None:
        if state.head == "token":
            raise ValueError(
                "labels= under batch='local': compute the loss of the logits "
                "with local_tokens(labels, groups), or parallelize with batch='full'"
            )
        raise ValueError(
            "labels= would shift within each rank's shard (batch='local'): compute the loss "
            "with next_token_labels and local_tokens, or parallelize with batch='full'"
        )
    share, ranks = tokens.shape[1], state.ranks()
    what = f"batch='local': this rank's {share} tokens (x {ranks} ranks = {share * ranks})"
    check_shards(share * ranks, state.groups, what)
    return tokens


def _check_local(tokens: torch.Tensor | None, state, verdict) -> None:
    """batch="local", at the first call (every call under FUSEDPAR_CHECKS=all): the same
    ValueError on every rank where a rank refused its call (`verdict`; `tokens` None
    there), where the ranks sharing a sequence (all but dp) hold shares of different
    shapes, or where a batch looks unsharded (the same tokens on the ranks of tp, or of
    cp): one all-gather over the stage's mesh of the verdicts, the shapes and the
    tokens' fingerprints, where the mesh has more than one rank; otherwise this rank's
    refusal, alone."""
    if not state.gathers or not checks.due(state, *([] if tokens is None else [tokens])):
        verdict.reraise()
        return
    mesh, dp = state.mesh, _dp_axis(state)
    shape = () if tokens is None else tokens.shape
    fingerprint = [0, 0, 0] if tokens is None else comm.fingerprint(tokens).tolist()
    hint = (
        "Each rank takes its own share of one batch, local_tokens(input_ids, groups), of "
        "one shape on the ranks of a cp x tp group"
    )
    shares = checks.agree_on_mesh(
        "batch='local'", mesh, {"tokens": shape}, verdict, apart=dp, hint=hint, carried=fingerprint
    )
    table = torch.tensor([shares[rank] for rank in mesh.mesh.flatten().tolist()])
    table = table.view(*mesh.shape, 3)
    for axis, name in enumerate(mesh.mesh_dim_names):
        if axis == dp or mesh.size(axis) == 1:
            continue
        same = (table.amax(axis) == table.amin(axis)).all(-1)  # the mesh without `axis`
        if bool(same.any()):
            where = tuple(int(i) for i in same.nonzero()[0])
            alike = mesh.mesh.movedim(axis, -1)[where].tolist()  # the ranks along `axis` there
            raise ValueError(
                f"batch='local': the ranks of mesh axis {name!r} hold the same tokens "
                f"({checks.ranks_text(alike)}, for one); each takes its own share, "
                "local_tokens(input_ids, groups) (or parallelize with batch='full' and "
                "pass the whole batch)"
            )
    checks.passed(state)


def _dp_axis(state) -> int | None:
    """The index of the mesh's dp axis (whatever its name), None without one."""
    names = mesh_axes_of(state.groups.get("dp"), state.mesh)
    return state.mesh.mesh_dim_names.index(names[0]) if names else None


def pool(state, module, args, output):
    """Forward hook on a sequence classifier's score: its logits (B, S_loc, L) of this
    rank's tokens -> each row's logits at its pooled token (`Batch.pooled`), wherever
    that token lives, the same on every rank; returned repeated over the S_loc positions,
    where Hugging Face's forward picks one of them per row. The sum over the ranks enters
    detached: the gradient reaches the owner's token only, once."""
    mine = state.token_positions == state.pooled[:, None]  # (B, S_loc): at most one per row
    local = torch.where(mine[..., None], output, output.new_zeros(())).sum(1)  # (B, L)
    total = local.detach()
    for axis in SEQUENCE_AXES:  # one rank holds the token, the others add zeros: exact
        total = comm.all_reduce(total, state.groups.get(axis))
    pooled = total + (local - local.detach())  # the value: total's; the gradient: local's
    return pooled[:, None].expand_as(output)


def add_loss(module, args, kwargs, output):
    """Forward hook: under "full" with labels (a causal LM's, or a token classifier's),
    the loss over the whole sequence. Its value is the global mean (Hugging Face's, or the
    sum over `num_items_in_batch`); its gradient is this rank's tokens' share, which
    `distribute` sums over cp and tp."""
    state = module._fusedpar_batch
    pending = state.pending.pop() if state.pending else None
    if pending is None or output is None:
        return output
    labels, num_items = pending
    logits = output.logits if hasattr(output, "logits") else output[0]
    wide = accumulator(logits.dtype)  # fp32 (Hugging Face's upcast); float64 stays float64
    local_sum = F.cross_entropy(
        logits.flatten(0, 1).to(wide), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    totals = torch.stack([local_sum.detach(), (labels != -100).sum().to(local_sum.dtype)])
    for axis in SEQUENCE_AXES:
        totals = comm.all_reduce(totals, state.groups.get(axis))
    denominator = totals[1] if num_items is None else num_items
    # the total's value on every rank, bit for bit (x - x is 0: local + (total - local)
    # would round differently per rank); the gradient this rank's tokens'
    loss = (totals[0] + (local_sum - local_sum.detach())) / denominator
    if hasattr(output, "logits"):
        output.loss = loss
        return output
    return (loss, *output)


def check_shards(seq: int, groups: dict, what: str | None = None) -> None:
    """ValueError unless a sequence of `seq` tokens splits into this sharding's chunks:
    2 x CP (zigzag), each CP shard into ULYSSES parts, each of those into TP chunks.
    `what`: the tokens' name in the message (the batch's `seq` tokens)."""
    cp, ulysses, tp = (comm.group_size(groups.get(axis)) for axis in SEQUENCE_AXES)
    chunks = 2 * cp if cp > 1 else 1
    per_rank = seq // chunks // ulysses
    what = what or f"the batch's {seq} tokens"
    if seq % chunks or (seq // chunks) % ulysses or per_rank % tp:
        raise ValueError(
            f"{what} do not split into its shards: "
            f"zigzag over cp ({chunks} chunks), then ulysses ({ulysses}), then tp ({tp}); "
            f"pad or cut the sequences to a multiple of {chunks * ulysses * tp}"
        )


def local_tokens(t: torch.Tensor, groups: dict) -> torch.Tensor:
    """(B, S, ...) on every rank -> this rank's (B, S / CP / ULYSSES / TP, ...): the zigzag
    CP shard of the sequence, its contiguous part over the Ulysses group (the hybrid
    layout), then this TP rank's chunk of it."""
    check_shards(t.shape[1], groups)
    t = shard_sequence(t, groups["cp"], dim=1, ulysses_group=groups.get("ulysses"))
    tp = comm.group_size(groups["tp"])
    return t.chunk(tp, dim=1)[comm.group_rank(groups["tp"])]


def full_logits(logits: torch.Tensor, groups: dict) -> torch.Tensor:
    """The inverse of `local_tokens` (differentiable): (B, S / CP / ULYSSES / TP, V) ->
    (B, S, V)."""
    logits = comm.gather_from_region(logits, groups["tp"], dim=1)
    return gather_sequence(logits, groups["cp"], dim=1, ulysses_group=groups.get("ulysses"))


def next_token_labels(input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, S) -> labels (B, S): token i+1 at i, `ignore_index` last. Shift before sharding:
    a shard's last token's label lives on another rank."""
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    return labels
