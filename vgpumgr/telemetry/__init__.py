"""Per-VM vGPU telemetry: NVML's readings per running vGPU (read.py), joined with vgpumgr's records
(snapshot.py), sampled by the service into a bounded history (history.py, sampler.py), rendered for Prometheus
(metrics.py) and checked against the licence ledger (licence_check.py)."""
