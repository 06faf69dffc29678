"""Measurement: cells, the runner, prompts and corpora, open loop, SLOs, capacity, the study's experiments, answers."""
