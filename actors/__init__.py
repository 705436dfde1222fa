"""Monarch actors only: generator, trainer and teacher-replay, each a thin shell over a core that
runs without Monarch."""
