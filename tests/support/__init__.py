"""Helpers the test modules share (no test module imports another): `hf_models`, the
tiny Hugging Face models of every family `parallelize` converts and their batches;
`hf_grads`, the gradients of an unconverted model a converted one's are held against;
`demo`, the example's training script run on a World's ranks; `tiny`, the example
model's tiny configs and token batches.

Importing this package puts examples/ on sys.path (tests/conftest.py imports it before
any test module): the tests import the examples (``tiny_llama``, ``train``) by name, and
World's ranks and the compile gate's workers take the driver's sys.path."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
EXAMPLES = ROOT / "examples"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
