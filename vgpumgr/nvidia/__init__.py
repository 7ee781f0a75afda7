"""What NVIDIA's driver knows and lets vgpumgr set, through NVML (nvml, facts, mixed, scheduler,
gi_scheduler, sched_fields, migration), the RmPVMRL registry value, and the vGPU migration rules (compat).
Layer 2 (drivers and rules): may import the base modules, hostfs, config and mig.
"""
