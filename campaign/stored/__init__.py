"""The stored run: its typed, versioned records and their format history (`records`), the run directory, its
migrations and the cells read back (`store`). Analysis, reports and exports read a night through this layer only."""
