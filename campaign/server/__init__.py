"""The server's lifecycle: launch profiles, argv, the process tree, the startup log, flag lists, the control plane,
/metrics, NVML.
"""
