"""MIG planning, pure: where a GPU instance profile can go (plan), its arithmetic (search), and a GPU's MIG
state in words (facts).
Layer 2 (drivers and rules): may import the base modules, hostfs and config.
"""
