"""Before a night, or instead of one: the plan and its estimate (`planning`), the host's limits (`limits`), the
matrix measured on the simulator's own clock (`replay`, `virtual`) and a tune's phase-1 search on it (`search`)."""
