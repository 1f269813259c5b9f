"""Benchmarks: one module per op family, each comparing fusedpar with the peer a user
would pick instead, in the same run. ``python -m bench [family ...]`` runs them."""
