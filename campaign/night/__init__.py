"""The night: one launch and its cells (`launch`), the night's rounds (`orchestrate`), the pool and its worker,
Ray. It owns the server's process tree; everything it measures is written through the stored run's layer."""
