"""Helpers the test modules share (no test module imports another): `hf_models`, the
tiny Hugging Face models of every family `parallelize` converts; `demo`, the example's
training script run on a World's ranks."""
