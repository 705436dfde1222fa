"""Monarch actors: generator, trainer and teacher-replay meshes, and the run controller (issue #4)."""
