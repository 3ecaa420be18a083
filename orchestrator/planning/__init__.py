"""Planning before start: the per-rank memory and FLOP estimates, layout picking, bubble theory, disk checks."""
