"""Tasks (environments) a run trains on: the protocol and the built-in toy agentic task."""
