"""Rollouts from workers outside the mesh: CURVE-encrypted ZMQ, leases, and verification of all they send."""
