"""Analysis of stored runs: the diff's statistics, per-cell verdicts and the recommendation. Reads stored files only."""
