"""`campaign tune`: the flow above the night and the analysis (it runs campaigns and reads their verdicts)."""
