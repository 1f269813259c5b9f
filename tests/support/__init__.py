"""Helpers the test modules share (no test module imports another): `hf_models`, the
tiny Hugging Face models of every family `parallelize` converts and their batches;
`hf_grads`, the gradients of an unconverted model a converted one's are held against;
`demo`, the example's training script run on a World's ranks."""
