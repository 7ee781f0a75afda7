"""The fleet: many hosts sharing one database, seen and placed as one.

Each host publishes what it has (its GPUs and their free instances per vGPU type) into rows that are a cache
of its own sysfs and records, with a time stamp; `place` chooses a host from those rows, and the chosen host's
own service still decides (its placement is the final word). A cordoned host gets nothing new.
Layer 6 (use cases): may import every layer below, and ops and telemetry beside it.
"""
