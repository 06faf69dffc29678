"""The simulator: a deterministic vLLM stand-in (engine, blocks, model, text) and its HTTP front. Imports only core."""
