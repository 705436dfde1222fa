"""Engines that sample (HF on CPU, vLLM on GPU), the completion contract they share, tool-call
parsing of completions, and the flat weight layout generators load."""
