"""Conversions of other libraries' models to fusedpar layers (optional dependencies)."""
