"""autograd Functions and the functional API, one module per op family."""
