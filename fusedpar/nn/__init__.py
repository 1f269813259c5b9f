"""nn.Modules built from fusedpar.ops: parallel linears, attention, MoE."""
