"""Test tiers: the CPU tier (default) runs Triton in its interpreter; ``pytest -m gpu``
runs the GPU tier with compiled kernels. ``@triton.jit`` reads ``TRITON_INTERPRET`` when a
kernel is decorated, so it is set here, before any test module imports triton; spawned
ranks inherit it from this process's environment.

Which implementation runs the ops (`fusedpar.implementation`): ``auto`` unless a test
says otherwise, which on a CPU is torch's, at CPU speed: composition (rings, TP, EP,
layers, checkpoints, compile, models) is tested that way. The kernels' own tests take
the fixture `triton_kernels` (Triton's kernels, in the interpreter), their property
tests `each_implementation` (both, each against float64), and a few end-to-end tests
of the layers keep Triton's kernels too.
"""

import os
import sys

_CHOSEN_BY_USER = "TRITON_INTERPRET" in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tests.support  # noqa: E402, F401 (puts examples/ on sys.path before the test modules import them)


def _gpu_tier_selected(config) -> bool:
    markexpr = (config.getoption("markexpr") or "").replace(" ", "")
    return markexpr == "gpu"


def pytest_configure(config):
    if _gpu_tier_selected(config) and not _CHOSEN_BY_USER:
        assert "triton" not in sys.modules, "triton was imported before conftest chose the tier"
        os.environ["TRITON_INTERPRET"] = "0"
    from fusedpar.testing.strategies import register_profiles

    # CI: 4 examples per property test, not the helper's 10 (the suite ran 11:22 on 2
    # cores with 10, over its 10-minute budget; with the planner's tests a clean clone's
    # .ci/run took 8:53-11:20 at 6 examples, 10:01 at 5, on this machine); locally
    # ("dev") 25.
    register_profiles(ci_examples=4)


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        reason = "CUDA is not available: the GPU tier needs a GPU"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "this run interprets Triton kernels; run the GPU tier with `pytest -m gpu`"
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def triton_kernels():
    """The test's ops run fusedpar's Triton kernels (in the interpreter on a CPU), in
    this process and on the ranks of `World.run`."""
    import fusedpar as fp

    with fp.implementation("triton"):
        yield


@pytest.fixture(params=["triton", "torch"])
def each_implementation(request):
    """The test runs once on each implementation of the ops; yields its name."""
    import fusedpar as fp

    with fp.implementation(request.param):
        yield request.param


@pytest.fixture(scope="session")
def world():
    """``world(n)``: the session's pool of n ranks (one per size, reused by every test)."""
    from fusedpar.testing import shared_world

    used = []

    def get(world_size: int):
        w = shared_world(world_size)
        used.append(w)
        return w

    yield get
    for w in used:
        w.close()
