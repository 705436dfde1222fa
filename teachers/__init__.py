"""Teacher backends for trace replay (OpenAI-compatible, HF, the task oracle), the answer cache and the cost meter."""
