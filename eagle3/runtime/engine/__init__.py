"""Engine: sequences, paged KV bookkeeping, scheduling, model execution and the LLM API."""
