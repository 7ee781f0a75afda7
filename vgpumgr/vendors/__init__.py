"""Other vendors' accelerators as data (profiles) and the mode steps their cards need before slices exist
(steps), and where their drivers keep per-VF quotas (quota_paths).
Layer 3 (devices): may import the base modules, hostfs, config, discovery and backends.
"""
