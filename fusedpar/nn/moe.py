"""`MoE`: a mixture-of-experts layer whose SwiGLU experts are spread over an EP group."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from fusedpar import checks, comm
from fusedpar.kernels.moe import Swiglu
from fusedpar.nn.moe_balance import check_rate, count_step_load, load_stats, update_expert_bias
from fusedpar.nn.specs import FromSpec, MoESpec
from fusedpar.ops.gated_down import gated_down
from fusedpar.ops.moe import Experts, Routing, moe_dispatch_combine
from fusedpar.ops.moe_routing import (
    aux_losses,
    capacity_mask,
    fold_groups,
    route,
    sequence_aux_loss,
)
from fusedpar.placement import Placement
from fusedpar.recompute import is_recomputing
from fusedpar.storage import ParamLayout, local_tensor

__all__ = ["MoE", "load_stats", "update_expert_bias"]


class MoE(FromSpec, nn.Module):
    """Top-k routed SwiGLU experts; ``forward(x) -> (y, aux_loss)``.

    x (..., d_model): this rank's tokens (any leading shape, zero tokens allowed); y has
    x's shape. Experts ``[r*E/W, (r+1)*E/W)`` live on EP rank r; expert e computes
    ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``, or with ``bias=True`` and
    ``activation="clamped_swiglu"`` (OpenAI's gpt-oss) ``w2[e] @ a + b2[e]`` with
    ``g = w1[e] @ x + b1[e]``, ``u = w3[e] @ x + b3[e]``, ``g' = min(g, L)``, ``u' =
    clamp(u, -L, L)``, ``a = (u' + 1) * g' * sigmoid(alpha * g')`` (alpha =
    ``swiglu_alpha``, default 1.702; L = ``swiglu_limit``, default 7.0; both for that
    activation only). ``router_bias=True`` adds a trainable bias to the router's logits
    (gpt-oss's; with softmax scores and ``norm_topk_prob`` the weights are the softmax
    of the k chosen logits, as gpt-oss's router computes them). ``n_group`` and
    ``topk_group``: the choice among the experts of the ``topk_group`` best of
    ``n_group`` groups, a group scored by its two best selection scores (DeepSeek-V3's
    router); ``routed_scaling_factor`` multiplies the routed weights (after any
    renormalization; DeepSeek-V3 2.5, GLM-4.5 1.0 to 2.5).

    | parameter       | shape on a rank        | notes                                  |
    | --------------- | ---------------------- | -------------------------------------- |
    | `router_weight` | (E, d_model)           | whole on every rank                    |
    | `router_bias`   | (E,)                   | ``router_bias=True``; whole            |
    | `w1`, `w3`      | (E/W, d_hidden, d_model) | this rank's experts                  |
    | `w2`            | (E/W, d_model, d_hidden) |                                      |
    | `b1`, `b3`; `b2` | (E/W, d_hidden); (E/W, d_model) | ``bias=True``; this rank's experts |
    | `expert_bias`   | (E,) buffer, sigmoid only | shifts selection, not the weights   |
    | `shared_w1`, `shared_w3`; `shared_w2` | (hs, d_model); (d_model, hs) | ``shared_hidden=hs`` |
    | `shared_gate_weight` | (1, d_model)      | ``shared_gate=True``                   |

    With ``shared_hidden`` every token also goes through a shared SwiGLU expert (whole
    on every rank, on this rank's tokens), added to the routed output, scaled by
    ``sigmoid(x @ shared_gate_weight.T)`` with ``shared_gate`` (Qwen2-MoE; DeepSeek's
    shared experts are ungated).

    Router math is fp32. ``aux_loss`` = Switch load balancing (``aux_loss_coef``) + router
    z-loss (``z_loss_coef``), over this rank's tokens; with ``aux_loss="sequence"``
    DeepSeek-V3's sequence-wise balance (alpha = ``aux_loss_coef``; x (B, S_local,
    d_model)) in place of Switch's, each sequence's expert counts summed over the ranks
    holding its tokens (the placement's cp, ulysses, and tp where sequence-parallel), and
    the value returned this rank's share (`fusedpar.ops.moe_routing.sequence_aux_loss`;
    for logging sum it over those ranks). Dropless unless
    ``capacity_factor`` is set: then each expert takes at most
    ``ceil(capacity_factor * T * k / E)`` of a rank's (token, slot) pairs, its
    highest-weighted ones, and dropped pairs add 0. ``last_stats`` holds the local tokens
    per expert and the dropped fraction of the last forward (activation checkpointing's
    recompute leaves it alone: `fusedpar.recompute.is_recomputing`).

    Under activation checkpointing the routing is recomputed bit for bit (the router is
    deterministic, and so is the dispatch: no atomics), so the recompute sends every
    token where the forward did; `fusedpar.checkpoint_policy` saves the top-k and the
    all-to-alls' outputs outright.

    In training each forward adds its tokens per expert to the step's count;
    `update_expert_bias` (after ``optimizer.step()``) sums it over the ranks and, with
    ``bias_update_rate=u`` (sigmoid scores only), moves ``expert_bias`` by
    ``u * sign(mean load - load_e)`` (DeepSeek-V3's loss-free balancing; `load_stats`:
    the step's loads, `fusedpar.nn.moe_balance`).

    The router (and its bias), like every parameter not split over the EP group, gets
    the gradient of this rank's tokens: the ranks of an EP group see different tokens.
    With the parameters on the mesh (`fusedpar.distribute`) that gradient is declared a
    partial sum and summed over them after backward, as for the rest of the model. The
    expert biases, like the expert weights, get the gradient of every token routed to
    this rank's experts, from every rank.

    Built from these keywords, or ``from_spec(MoESpec, Placement)`` (`fusedpar.nn.specs`;
    the placement's ``ep_group``, and with ``aux_loss="sequence"`` its ``cp_group``,
    ``ulysses_group``, ``tp_group`` and ``sequence_parallel``, keywords here too), the
    same layer either way, which keeps both
    (``self.spec``, ``self.placement``).
    """

    SPEC = MoESpec
    _fusedpar_checked = False  # until the first call's checks pass (`fusedpar.checks`)

    def __init__(
        self,
        d_model,
        d_hidden,
        num_experts,
        top_k,
        ep_group=None,
        *,
        score="softmax",
        norm_topk_prob=True,
        capacity_factor=None,
        aux_loss_coef=0.01,
        z_loss_coef=0.0,
        shared_hidden=0,
        shared_gate=False,
        bias=False,
        router_bias=False,
        activation="silu",
        swiglu_alpha=None,
        swiglu_limit=None,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        bias_update_rate=None,
        aux_loss="switch",
        cp_group=None,
        ulysses_group=None,
        tp_group=None,
        sequence_parallel=True,
        device=None,
        dtype=None,
    ):
        spec = MoESpec(
            d_model,
            d_hidden,
            num_experts,
            top_k,
            score=score,
            norm_topk_prob=norm_topk_prob,
            capacity_factor=capacity_factor,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            shared_hidden=shared_hidden,
            shared_gate=shared_gate,
            bias=bias,
            router_bias=router_bias,
            activation=activation,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            bias_update_rate=bias_update_rate,
            aux_loss=aux_loss,
        )
        # (cp, ulysses, tp and sequence_parallel: read by aux_loss="sequence" alone)
        placement = Placement(
            ep_group=ep_group,
            cp_group=cp_group,
            ulysses_group=ulysses_group,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
        )
        self._build(spec, placement, device, dtype)

    def _build(self, spec: MoESpec, placement: Placement, device, dtype) -> None:
        """The layer of `spec` on `placement`'s ``ep_group`` (`__init__` and
        `from_spec`): the experts over the group checked, then the parameters."""
        super().__init__()  # (cooperative: a subclass's other bases too)
        self.spec, self.placement = spec, placement
        ep_group, num_experts = placement.ep_group, spec.num_experts
        world = comm.group_size(ep_group)
        if num_experts < 1 or num_experts % world:
            raise ValueError(
                f"num_experts ({num_experts}) must be a positive multiple of the "
                f"EP group size ({world})"
            )
        self.groups = (spec.n_group, spec.topk_group)
        self.routed_scaling_factor = float(spec.routed_scaling_factor)
        d_model, d_hidden = spec.d_model, spec.d_hidden
        self.d_model, self.d_hidden, self.num_experts, self.top_k = (
            d_model,
            d_hidden,
            num_experts,
            spec.top_k,
        )
        self.ep_group, self.world, self.rank = ep_group, world, comm.group_rank(ep_group)
        self.score, self.norm_topk_prob, self.capacity_factor = (
            spec.score,
            spec.norm_topk_prob,
            spec.capacity_factor,
        )
        self.aux_loss_coef, self.z_loss_coef = spec.aux_loss_coef, spec.z_loss_coef
        self.aux_loss = spec.aux_loss
        # aux_loss="sequence": the groups a sequence's tokens are split over (cp, ulysses,
        # and tp where the layer's input is sequence-parallel), folded (`fold_groups`)
        self.sequence_groups = ()
        if spec.aux_loss == "sequence":
            tp = placement.tp_group if placement.sequence_parallel else None
            self.sequence_groups = fold_groups((placement.cp_group, placement.ulysses_group, tp))
        self.activation = spec.activation
        self.swiglu_alpha, self.swiglu_limit = (float(v) for v in spec.swiglu())
        local, factory = num_experts // world, {"device": device, "dtype": dtype}
        self.router_weight = nn.Parameter(torch.empty(num_experts, d_model, **factory))
        self.w1 = nn.Parameter(torch.empty(local, d_hidden, d_model, **factory))
        self.w3 = nn.Parameter(torch.empty(local, d_hidden, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(local, d_model, d_hidden, **factory))
        for name, shape, on in (
            ("router_bias", (num_experts,), spec.router_bias),
            ("b1", (local, d_hidden), spec.bias),
            ("b2", (local, d_model), spec.bias),
            ("b3", (local, d_hidden), spec.bias),
        ):
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, **factory)) if on else None
            )
        self.shared_hidden = shared_hidden = spec.shared_hidden
        shared = shared_hidden > 0
        for name, shape in (
            ("shared_w1", (shared_hidden, d_model)),
            ("shared_w2", (d_model, shared_hidden)),
            ("shared_w3", (shared_hidden, d_model)),
            ("shared_gate_weight", (1, d_model)),
        ):
            on = spec.shared_gate if name == "shared_gate_weight" else shared
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, **factory)) if on else None
            )
        bias = torch.zeros(num_experts, device=device) if spec.score == "sigmoid" else None
        self.register_buffer("expert_bias", bias)
        check_rate(spec.bias_update_rate, spec.score)
        self.bias_update_rate = spec.bias_update_rate
        # (E,) int64 each: this step's local tokens per expert (None: none yet), and the
        # last step's over the update's group (`moe_balance`; neither in the state dict)
        self.step_load = self.last_step_load = None
        self.last_stats: dict = {}
        if self.router_weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization for the router and each full expert stack (and
        their biases), drawn in float32 on the CPU from the current RNG state: one seed,
        one model, any W."""

        def linear_init(*shape, fan_in=None):  # (..., out, in), bound 1/sqrt(in) as nn.Linear
            return torch.empty(shape).uniform_(-1, 1) / math.sqrt(fan_in or shape[-1])

        E, d, h, hs = self.num_experts, self.d_model, self.d_hidden, self.shared_hidden
        extras = {}
        if hs:
            extras["shared"] = (linear_init(hs, d), linear_init(d, hs), linear_init(hs, d))
        if self.shared_gate_weight is not None:
            extras["shared_gate_weight"] = linear_init(1, d)
        stacks = (
            linear_init(E, d),
            linear_init(E, h, d),
            linear_init(E, d, h),
            linear_init(E, h, d),
        )
        if self.b1 is not None:  # drawn after the weights: a layer without them is unchanged
            extras["bias"] = (
                linear_init(E, h, fan_in=d),
                linear_init(E, d, fan_in=h),
                linear_init(E, h, fan_in=d),
            )
        if self.router_bias is not None:
            extras["router_bias"] = linear_init(E, fan_in=d)
        self.load_dense(*stacks, **extras)

    def load_dense(
        self,
        router_weight,
        w1,
        w2,
        w3,
        *,
        shared=None,
        shared_gate_weight=None,
        bias=None,
        router_bias=None,
        expert_bias=None,
    ) -> None:
        """Copy the full (unsharded) router and expert stacks, keeping this rank's experts,
        the expert biases ``bias=(b1 (E, h), b2 (E, d), b3 (E, h))`` (this rank's too) and
        the router's bias (E,), and the shared expert (w1, w2, w3) and its gate
        (1, d_model) where this layer has them (and only there: nothing given is
        ignored); `expert_bias` (E,): the sigmoid router's selection bias (DeepSeek-V3's
        ``e_score_correction_bias``)."""
        E, d, h, hs = self.num_experts, self.d_model, self.d_hidden, self.shared_hidden
        if expert_bias is not None:
            if self.expert_bias is None:
                raise ValueError(
                    "expert_bias given but this MoE scores by softmax: it shifts "
                    "a sigmoid router's choice only"
                )
            if tuple(expert_bias.shape) != (E,):
                raise ValueError(f"expert_bias must be ({E},), got {tuple(expert_bias.shape)}")
            with torch.no_grad():
                self.expert_bias.copy_(expert_bias)
        for what, value, param, option in (
            ("expert biases", bias, self.b1, "bias"),
            ("a router bias", router_bias, self.router_bias, "router_bias"),
        ):
            if (value is None) != (param is None):
                given = "given" if value is not None else "missing"
                raise ValueError(
                    f"{what} {given} but this MoE was built with {option}={param is not None}"
                )
        if (shared is None) != (hs == 0):
            raise ValueError(
                f"a shared expert {'given' if shared is not None else 'missing'} "
                f"but this MoE was built with shared_hidden={hs}"
            )
        if (shared_gate_weight is None) != (self.shared_gate_weight is None):
            given = "given" if shared_gate_weight is not None else "missing"
            raise ValueError(
                f"a shared gate {given}"
                f" but this MoE was built with shared_gate="
                f"{self.shared_gate_weight is not None}"
            )
        checks = [
            ("router_weight", router_weight, (E, d)),
            ("w1", w1, (E, h, d)),
            ("w2", w2, (E, d, h)),
            ("w3", w3, (E, h, d)),
        ]
        if shared is not None:
            shapes = ((hs, d), (d, hs), (hs, d))
            names = ("shared w1", "shared w2", "shared w3")
            checks += list(zip(names, shared, shapes, strict=True))
        if shared_gate_weight is not None:
            checks.append(("shared_gate_weight", shared_gate_weight, (1, d)))
        if bias is not None:
            checks += list(zip(("b1", "b2", "b3"), bias, ((E, h), (E, d), (E, h)), strict=True))
        if router_bias is not None:
            checks.append(("router_bias", router_bias, (E,)))
        for name, t, shape in checks:
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
        mine = slice(self.rank * E // self.world, (self.rank + 1) * E // self.world)
        experts = [(self.w1, w1), (self.w2, w2), (self.w3, w3)]
        if bias is not None:
            experts += zip((self.b1, self.b2, self.b3), bias, strict=True)
        with torch.no_grad():
            local_tensor(self.router_weight).copy_(router_weight)
            if router_bias is not None:
                local_tensor(self.router_bias).copy_(router_bias)
            for param, full in experts:
                local_tensor(param).copy_(full[mine])
            for param, full in zip(
                (self.shared_w1, self.shared_w2, self.shared_w3), shared or (), strict=False
            ):
                local_tensor(param).copy_(full)
            if shared_gate_weight is not None:
                local_tensor(self.shared_gate_weight).copy_(shared_gate_weight)

    def param_layouts(self) -> dict:
        """For `fusedpar.distribute`: the expert stacks and their biases split over the EP
        group; the router and its bias whole (their gradient is this rank's tokens')."""
        experts, whole = ParamLayout(0, self.ep_group), ParamLayout()
        return {
            "router_weight": whole,
            "router_bias": whole,
            "w1": experts,
            "w2": experts,
            "w3": experts,
            "b1": experts,
            "b2": experts,
            "b3": experts,
            "shared_w1": whole,
            "shared_w2": whole,
            "shared_w3": whole,
            "shared_gate_weight": whole,
        }

    @classmethod
    def from_dense(
        cls,
        router_weight,
        w1,
        w2,
        w3,
        ep_group=None,
        *,
        shared=None,
        shared_gate_weight=None,
        bias=None,
        router_bias=None,
        expert_bias=None,
        **kwargs,
    ):
        """A layer holding this rank's share of full stacks: router_weight (E, d_model);
        w1, w3 (E, d_hidden, d_model); w2 (E, d_model, d_hidden); optionally the experts'
        biases ``bias=(b1 (E, d_hidden), b2 (E, d_model), b3 (E, d_hidden))``, the
        router's ``router_bias`` (E,), a shared expert ``shared=(w1 (hs, d), w2 (d, hs),
        w3 (hs, d))`` and its gate ``shared_gate_weight`` (1, d); ``bias``,
        ``router_bias``, ``shared_hidden``, ``shared_gate`` read off them. gpt-oss:
        ``from_dense(..., bias=..., router_bias=..., top_k=4,
        activation="clamped_swiglu")`` with its gate_up_proj de-interleaved into w1, w3
        (transposed to (E, h, d))."""
        kwargs.setdefault("shared_hidden", 0 if shared is None else shared[0].shape[0])
        kwargs.setdefault("shared_gate", shared_gate_weight is not None)
        kwargs.setdefault("bias", bias is not None)
        kwargs.setdefault("router_bias", router_bias is not None)
        if "top_k" not in kwargs:
            raise TypeError("MoE.from_dense needs top_k=...")
        num_experts, d_model = router_weight.shape
        kwargs.setdefault("dtype", w1.dtype)
        device = kwargs.pop("device", w1.device)
        layer = cls(
            d_model,
            w1.shape[1],
            num_experts,
            kwargs.pop("top_k"),
            ep_group,
            device="meta",
            **kwargs,
        )
        layer.to_empty(device=device)
        if layer.expert_bias is not None:
            layer.expert_bias.zero_()
        extras = {}
        if shared is not None:
            extras["shared"] = tuple(t.detach() for t in shared)
        if shared_gate_weight is not None:
            extras["shared_gate_weight"] = shared_gate_weight.detach()
        if bias is not None:
            extras["bias"] = tuple(t.detach() for t in bias)
        if router_bias is not None:
            extras["router_bias"] = router_bias.detach()
        if expert_bias is not None:
            extras["expert_bias"] = expert_bias.detach()
        layer.load_dense(router_weight.detach(), w1.detach(), w2.detach(), w3.detach(), **extras)
        return layer

    def _sequences(self, x: torch.Tensor) -> tuple[int, int]:
        """(B, S_local) of x (B, S_local, d_model), which aux_loss="sequence" needs."""
        if x.dim() != 3:
            raise ValueError(
                f"MoE(aux_loss='sequence') takes x (B, S_local, d_model={self.d_model}), "
                f"its sequences on dim 0, got {tuple(x.shape)}"
            )
        return x.shape[0], x.shape[1]

    def _first_call_checks(self, x: torch.Tensor) -> None:
        """`fusedpar.checks` over the EP group (and the sequence groups): tokens per rank
        may differ, their features may not; with aux_loss="sequence" x must be 3-D on
        every rank (a refusal on each) and hold as many sequences as the ranks that
        hold the rest of them (their counts are summed)."""
        verdict, due = checks.Verdict(), checks.due(self, x)
        sequences = verdict.run(self._sequences, x) if self.aux_loss == "sequence" else None
        if due and self.sequence_groups:
            # first, on every rank of them (a local refusal travels in their gather); its
            # verdict then goes to the EP group's gather below, so that ranks outside a
            # refusing sequence group (EP over dp) raise too rather than wait in the
            # all-to-all
            what = "MoE(aux_loss='sequence') (over its sequence groups)"
            batch = {"sequences": -1 if sequences is None else sequences[0]}
            agreed = checks.Verdict()
            agreed.run(checks.agree, what, self.sequence_groups, batch, x.device, verdict)
            verdict = agreed if agreed.error is not None else verdict
        groups = {"ep_group": self.ep_group}
        groups.update({f"sequence_groups[{i}]": g for i, g in enumerate(self.sequence_groups)})
        features = {
            "x features": x.shape[-1] if x.dim() else -1,
            "x dtype": x.dtype,
            "expert dtype": self.w1.dtype,
        }
        checks.first_call(self, x, groups, features, verdict)

    def forward(self, x: torch.Tensor):
        if not self._fusedpar_checked:
            self._first_call_checks(x)
        sequences = self._sequences(x) if self.aux_loss == "sequence" else None
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: x must be (..., d_model={self.d_model}), got {tuple(x.shape)}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"MoE: x is {x.dtype} but the experts are {self.w1.dtype}")
        x2d = x.reshape(-1, self.d_model)
        weights, ids, probs, logits = route(
            x2d,
            self.router_weight,
            self.top_k,
            self.score,
            self.norm_topk_prob,
            self.expert_bias,
            self.router_bias,
            self.groups,
            self.routed_scaling_factor,
        )
        keep = None
        if self.capacity_factor is not None:
            keep = capacity_mask(ids, weights, self.num_experts, self.capacity_factor)
        experts = Experts(self.w1, self.w3, self.w2, self.b1, self.b3, self.b2)
        act = Swiglu(self.activation, self.swiglu_alpha, self.swiglu_limit)
        y, counts = moe_dispatch_combine(
            x2d, Routing(weights, ids, keep), experts, self.num_experts, self.ep_group, act
        )
        if not is_recomputing():  # activation checkpointing's re-run counts nothing again
            if keep is None:  # dropless: none dropped
                dropped = counts.new_zeros((), dtype=torch.float32)
            else:  # a device tensor: no host sync for the stats
                dropped = (ids.numel() - counts.sum()).float() / max(1, ids.numel())
            self.last_stats = {"tokens_per_expert": counts.detach(), "dropped_fraction": dropped}
            if self.training:
                count_step_load(self, ids, counts if keep is None else None)
        if self.aux_loss == "sequence":  # each sequence's choices, summed over its ranks
            coefs = (self.aux_loss_coef, self.z_loss_coef)
            aux = sequence_aux_loss(
                probs, logits, ids, sequences, self.sequence_groups, coefs, self.score
            )
        else:
            counted = counts if keep is None else None  # (after a capacity's drops: not these)
            aux = aux_losses(
                probs, logits, ids, self.score, self.aux_loss_coef, self.z_loss_coef, counts=counted
            )
        if self.shared_w1 is not None:
            gate, up = F.linear(x2d, self.shared_w1), F.linear(x2d, self.shared_w3)
            # saves gate and up, not silu(gate) nor the product (recomputed in the backward)
            shared = gated_down(
                gate, up, self.shared_w2, None, activation=F.silu, sequence_parallel=False
            )
            if self.shared_gate_weight is not None:
                shared = torch.sigmoid(F.linear(x2d, self.shared_gate_weight)) * shared
            y = y + shared
        return y.view(x.shape), aux

    def extra_repr(self) -> str:
        extra = ""
        if self.b1 is not None:
            extra += ", bias=True"
        if self.router_bias is not None:
            extra += ", router_bias=True"
        if self.groups != (1, 1):
            extra += f", groups={self.groups[1]} of {self.groups[0]}"
        if self.routed_scaling_factor != 1.0:
            extra += f", routed_scaling_factor={self.routed_scaling_factor}"
        if self.bias_update_rate is not None:
            extra += f", bias_update_rate={self.bias_update_rate}"
        if self.aux_loss != "switch":
            extra += f", aux_loss={self.aux_loss}"
        if self.activation != "silu":
            extra += (
                f", activation={self.activation}(alpha={self.swiglu_alpha}, "
                f"limit={self.swiglu_limit})"
            )
        return (
            f"d_model={self.d_model}, d_hidden={self.d_hidden}, experts={self.num_experts}"
            f" ({self.num_experts // self.world} here), top_k={self.top_k}, "
            f"score={self.score}, capacity_factor={self.capacity_factor}{extra}"
        )
