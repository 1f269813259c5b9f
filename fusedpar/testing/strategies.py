"""hypothesis profiles and strategies for property tests of parallel code.

hypothesis runs in the test process only: an example is a small picklable set of
parameters plus a seed, and each rank of a `World` rebuilds its tensors from them.
"""

import os

import torch

CPU_DTYPES = (torch.float32, torch.float16)  # the interpreter has no bf16 dot; gloo no bf16 sum


def register_profiles(ci_examples: int = 10, dev_examples: int = 25) -> str:
    """Register the "ci" and "dev" profiles and load one; return its name.

    "ci" (chosen when ``CI`` is set): derandomized, no example database, no deadline, no
    explain phase, a bounded example count, so CI runs the same examples every time.
    "dev": random examples, remembered in the local database. ``HYPOTHESIS_PROFILE``
    overrides the choice.
    """
    from hypothesis import HealthCheck, Phase, settings

    # function_scoped_fixture: a fixture that only sets a context for the test (which
    # implementation runs, `fusedpar.implementation`) holds for every example alike
    slow_ok = [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ]
    settings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=ci_examples,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=slow_ok,
        print_blob=True,
    )
    settings.register_profile(
        "dev", deadline=None, max_examples=dev_examples, suppress_health_check=slow_ok
    )
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name


def seeds():
    """Seeds for ``torch.Generator``: every example draws fresh random data."""
    from hypothesis import strategies as st

    return st.integers(min_value=0, max_value=2**31 - 1)


def cpu_dtypes():
    """The dtypes the CPU tier can test (fp32 and fp16)."""
    from hypothesis import strategies as st

    return st.sampled_from(CPU_DTYPES)


def randn(shape, dtype, seed: int, *, scale: float = 1.0, exact_in=None) -> torch.Tensor:
    """Reproducible standard-normal data: the same `seed` gives the same tensor on every rank.

    ``exact_in``: round the values to that dtype first, so a float64 oracle built from the
    result sees exactly the inputs the op under test sees (its error then measures the
    op, not the rounding of its inputs).
    """
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return (values if exact_in is None else values.to(exact_in)).to(dtype)
