"""Prometheus metrics: GPUs, vGPUs by type and state, licence seats per edition, allocation latency, and per
running vGPU what NVML reports of it (vgpumgr.telemetry), labelled with its VM, type, GPU and host.

Gauges are read at scrape time from the inventory snapshot and the database, so they are never stale;
each app has its own registry (several apps in one test process do not collide).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from vgpumgr import licensing
from vgpumgr.db import store
from vgpumgr.db.models import LIVE_STATES
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.service import Service

log = logging.getLogger("vgpumgr.api")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class _StateCollector(Collector):
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        try:
            inv = svc.snapshot().inventory
            gpus = GaugeMetricFamily("vgpumgr_gpus", "GPUs on this host", labels=["model"])
            for model, n in sorted(Counter(g.name for g in inv.gpus if not g.is_vf).items()):
                gpus.add_metric([model], n)
            yield gpus
            vgpus = GaugeMetricFamily("vgpumgr_vgpus", "vGPU allocations of this host (reserved/active)",
                                      labels=["type", "state"])
            with svc.sessions() as s:
                host = store.get_host(s, svc.hostname)
                label = func.coalesce(AllocRow.type_name, AllocRow.type_id)
                stmt = (select(label, AllocRow.state, func.count())
                        .where(AllocRow.host_id == (host.id if host else -1), AllocRow.state.in_(LIVE_STATES))
                        .group_by(AllocRow.type_name, AllocRow.type_id, AllocRow.state))
                rows = s.execute(stmt).all()
                for type_name, state, n in rows:
                    vgpus.add_metric([type_name, state], n)
                usage = licensing.usage(s)
            yield vgpus
            used = GaugeMetricFamily("vgpumgr_licence_seats_used", "licence seats in use", labels=["edition"])
            free = GaugeMetricFamily("vgpumgr_licence_seats_free", "licence seats free", labels=["edition"])
            for e in usage:
                used.add_metric([e.edition], e.used)
                free.add_metric([e.edition], e.free)
            yield used
            yield free
        except Exception:  # a scrape must not fail because one source did
            log.exception("collecting metrics failed")


VGPU_LABELS = ["host", "gpu", "vm", "vm_uuid", "type", "vgpu"]
LICENCE_STATES = ("unknown", "uninitialized", "unlicensed-unrestricted", "unlicensed-restricted", "unlicensed",
                  "licensed")


def telemetry_families(snap: dict[str, Any]) -> list[Metric]:
    """The telemetry snapshot as Prometheus families (README "Metrics" lists them)."""
    def fam(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=VGPU_LABELS + list(extra))

    util = fam("vgpumgr_vgpu_utilization_ratio", "share of the engine's time this vGPU used (NVML)", ("engine",))
    fb_used = fam("vgpumgr_vgpu_framebuffer_used_bytes", "framebuffer the guest uses")
    fb_total = fam("vgpumgr_vgpu_framebuffer_total_bytes", "framebuffer of the vGPU's type")
    enc_s = fam("vgpumgr_vgpu_encoder_sessions", "NVENC sessions of the guest")
    enc_fps = fam("vgpumgr_vgpu_encoder_fps", "average NVENC frames per second")
    enc_lat = fam("vgpumgr_vgpu_encoder_latency_seconds", "average NVENC latency")
    fbc_s = fam("vgpumgr_vgpu_fbc_sessions", "frame buffer capture sessions of the guest")
    fbc_fps = fam("vgpumgr_vgpu_fbc_fps", "average FBC frames per second")
    fbc_lat = fam("vgpumgr_vgpu_fbc_latency_seconds", "average FBC latency")
    frl = fam("vgpumgr_vgpu_frame_rate_limit_fps", "frame rate limit of the vGPU")
    lic = fam("vgpumgr_vgpu_licence_state", "the guest's licence state as its driver reports it (1: current)",
              ("state",))
    expiry = fam("vgpumgr_vgpu_licence_expiry_timestamp_seconds", "when the guest's licence expires")
    for r in snap["vgpus"]:
        labels = [r["host"], r["gpu"], r["vm"] or "", r["vm_uuid"] or "", r["type"] or "", r["vgpu"] or ""]
        for engine, v in r["util"].items():
            if v is not None:
                util.add_metric(labels + [engine], v)
        for f, v in ((fb_used, r["fb_used_bytes"]), (fb_total, r["fb_total_bytes"]),
                     (enc_s, r["encoder"]["sessions"]), (enc_fps, r["encoder"]["fps"]),
                     (enc_lat, r["encoder"]["latency_s"]), (fbc_s, r["fbc"]["sessions"]), (fbc_fps, r["fbc"]["fps"]),
                     (fbc_lat, r["fbc"]["latency_s"]), (frl, r["frame_rate_limit"]),
                     (expiry, r["licence"]["expiry"])):
            if v is not None:
                f.add_metric(labels, v)
        for state in LICENCE_STATES:
            lic.add_metric(labels + [state], 1.0 if r["licence"]["state"] == state else 0.0)
    g_util = GaugeMetricFamily("vgpumgr_gpu_vgpu_utilization_ratio", "sum over the GPU's running vGPUs",
                               labels=["host", "gpu", "engine"])
    g_n = GaugeMetricFamily("vgpumgr_gpu_vgpus_running", "vGPUs NVML reports running on the GPU",
                            labels=["host", "gpu"])
    g_fb = GaugeMetricFamily("vgpumgr_gpu_vgpu_framebuffer_used_bytes", "framebuffer its vGPUs use",
                             labels=["host", "gpu"])
    g_free = GaugeMetricFamily("vgpumgr_gpu_free_slots", "vGPUs of the type the GPU could still take",
                               labels=["host", "gpu", "type"])
    g_absent = GaugeMetricFamily("vgpumgr_gpu_vgpu_telemetry_absent", "1: NVML gives no vGPU data for the GPU",
                                 labels=["host", "gpu"])
    for g in snap["gpus"]:
        if g["absent"]:
            g_absent.add_metric([g["host"], g["gpu"]], 1.0)
            continue
        for engine, v in g["util"].items():
            g_util.add_metric([g["host"], g["gpu"], engine], v)
        g_n.add_metric([g["host"], g["gpu"]], g["vgpus"])
        g_fb.add_metric([g["host"], g["gpu"]], g["fb_used_bytes"])
        for t, n in g["free_slots"].items():
            g_free.add_metric([g["host"], g["gpu"], t], n)
    taken = GaugeMetricFamily("vgpumgr_telemetry_sample_timestamp_seconds", "when the vGPU sample was taken",
                              labels=["host"])
    taken.add_metric([snap["host"]], snap["taken"])
    return [util, fb_used, fb_total, enc_s, enc_fps, enc_lat, fbc_s, fbc_fps, fbc_lat, frl, lic, expiry,
            g_util, g_n, g_fb, g_free, g_absent, taken]


class _TelemetryCollector(Collector):
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def collect(self) -> Iterator[Metric]:
        try:
            yield from telemetry_families(self.sampler.latest())
        except Exception:  # a scrape must not fail because NVML did
            log.exception("collecting vGPU telemetry failed")


class Metrics:
    def __init__(self, service: Service, sampler: Any | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(service))
        if sampler is not None:
            self.registry.register(_TelemetryCollector(sampler))
        self.allocation_seconds = Histogram("vgpumgr_allocation_seconds", "time to place and create one vGPU",
                                            buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_allocation(self, seconds: float) -> None:
        self.allocation_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
