"""The night: the matrix, planning, orchestration, the pool, Ray, the worker, the store and its records, progress,
replay in simulated time.
"""
