"""The audit trail and its anchors: the hash-chained events (chain), the host's signing key (key), the
signed checkpoints kept outside the database (checkpoints) and a `db restore`'s signed record among them (restore).
Layer 5 (records): may import the base modules, hostfs, config, db and licensing.
"""
