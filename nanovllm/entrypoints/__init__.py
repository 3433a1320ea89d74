"""Ways in to the engine for datasets: OpenAI batch files (`nanovllm.run_batch`) and Ray Data
(`nanovllm.ray`). They share the per-request checks and the one function that drives the engine."""
