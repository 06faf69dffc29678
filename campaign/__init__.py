"""vllm-campaign: launch vLLM with flag sets, measure it honestly, diff the configurations."""

__version__ = "0.1.0"
