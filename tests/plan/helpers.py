"""Helpers of the tests in this folder: `held_state` and `check_peaks` (moved from
test_plan.py), and `real_ops`: `GatedDeltaNet`'s recurrence as the planner counts it
(test_plan_gdn.py), its CPU backward's workspace kept out of the saved bytes."""


def held_state(model, optimizer) -> dict:
    """Bytes of the parameters, gradients and optimizer state this rank holds (local
    shards of DTensors)."""
    held = [
        model.parameters(),
        (p.grad for p in model.parameters()),
        (t for s in optimizer.state.values() for t in s.values()),
    ]
    local = (
        sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in ts) for ts in held
    )
    return dict(zip(("parameters", "gradients", "optimizer"), local, strict=True))


def check_peaks(results: list, where, summed: bool) -> None:
    """The most bytes of saved activations each rank held at once in its step (`peak`:
    real, planned, slack), or their sum over the ranks (`summed`: with EP, a rank's rows
    follow the routing), equal the planner's. Slack: in a pipeline the microbatches'
    token ids and labels are views of the whole batch's (int64) storages, which the
    real count holds whole and the planner counts per microbatch. (Not with EP in a
    pipeline: a rank's peak is the most its routed microbatches hold at once, above the
    balanced one's, and a sum of peaks is not the peak of a sum.)"""
    for group in [results] if summed else [[r] for r in results]:
        real, planned, slack = (sum(r["peak"][i] for r in group) for i in range(3))
        assert 0 <= real - planned <= slack, (where, real, planned, slack)
