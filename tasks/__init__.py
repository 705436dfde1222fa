"""Tasks (environments) a run trains on: the protocol, loading one by import path, and the built-in toy agentic task."""
