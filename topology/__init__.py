"""Placement of meshes on hosts: local, attached workers, SLURM (issue #5)."""
