"""Licence editions, seat pools and leases (seats), and the client configuration token as a secret of this
host (token).
Layer 5 (records): may import the base modules, hostfs, config, db and audit.
"""
