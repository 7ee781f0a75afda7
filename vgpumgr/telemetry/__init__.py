"""Per-VM vGPU telemetry: NVML's readings per running vGPU (read.py), joined with vgpumgr's records
(snapshot.py), sampled by the service into a bounded history (history.py, sampler.py), rendered for Prometheus
(metrics.py) and checked against the licence ledger (licence_check.py).
Layer 6 (use cases): may import every layer below, and ops and fleet beside it.
"""
