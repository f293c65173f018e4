"""Pure algorithm policies (no MPI inside): aggregation, and later consistency, gating,
residuals, allocation and ordering. The runtime wires them to messages."""
