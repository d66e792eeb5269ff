"""The bundled speculative runtime (Kimi target + EAGLE-3/3.1 draft, paged KV, continuous batching).

Public API: :class:`eagle3.runtime.engine.llm.LLM` and :class:`eagle3.runtime.sampling.SamplingParams`.
"""
