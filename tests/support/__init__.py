"""Helpers the test modules share (no test module imports another): `hf_models`, the
tiny Hugging Face models of every family `parallelize` converts."""
