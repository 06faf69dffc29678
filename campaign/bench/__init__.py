"""Benchmarks and checks that are not tests: the client's speed, cold start, scale-out, the GPU check, the truth run."""
