"""Choosing where a vGPU goes, as pure functions of a host snapshot: the placer, mixed-size placement IDs
(ids, mixed) and whole-device choice (whole).
Layer 4 (placement): may import the layers below it (base, hostfs, config, nvidia, mig, guest, platforms,
devices).
"""
