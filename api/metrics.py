"""Prometheus metrics: GPUs, vGPUs by type and state, licence seats per edition, allocation latency, the fleet's
place and publish latency, and per running vGPU what NVML reports of it (vgpumgr.telemetry), labelled with its
VM, type, GPU and host.

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

from vgpumgr.db import store
from vgpumgr.db.models import LIVE_STATES
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.licensing import seats as licensing
from vgpumgr.service import Service

log = logging.getLogger("vgpumgr.api")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
# a host's publish per change is meant to take at most 2 ms (the fleet's target): finer at the low end
PUBLISH_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
PLACE_RESULTS = ("placed", "no_room", "error")
PUBLISH_KINDS = ("change", "heartbeat", "full")


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
            yield from vendor_slice_metrics(inv)
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
            yield from _delivery_metrics(svc)
        except Exception:  # a scrape must not fail because one source did
            log.exception("collecting metrics failed")


def _delivery_metrics(svc: Service) -> Iterator[Metric]:
    """Per VM: when the licence token was last delivered, and the seconds from the VM's start to its guest's first
    licensed state (vgpumgr.ops.licence_delivery; fingerprints and tokens are never labels)."""
    from datetime import datetime

    from vgpumgr.ops import licence_delivery

    def ts(iso: str | None) -> float | None:
        return datetime.fromisoformat(iso).timestamp() if iso else None

    delivered = GaugeMetricFamily("vgpumgr_vm_licence_token_delivered_timestamp_seconds",
                                  "when the licence token was last delivered to the VM's guest",
                                  labels=["vm", "method"])
    took = GaugeMetricFamily("vgpumgr_vm_licence_time_to_licensed_seconds",
                             "seconds from the VM's start to its guest's first licensed state", labels=["vm"])
    for r in licence_delivery.records(svc).values():
        if r["delivered_at"]:
            delivered.add_metric([r["vm"], r["method"] or ""], ts(r["delivered_at"]))
        start, first = ts(r["started_at"]), ts(r["first_licensed_at"])
        if start is not None and first is not None:
            took.add_metric([r["vm"]], max(0.0, first - start))
    yield delivered
    yield took


VGPU_LABELS = ["host", "gpu", "vm", "vm_uuid", "type", "vgpu"]
LICENCE_STATES = ("unknown", "uninitialized", "unlicensed-unrestricted", "unlicensed-restricted", "unlicensed",
                  "licensed")


_VGPU_METRICS = (  # name, help, how to read it from a snapshot row
    ("vgpumgr_vgpu_framebuffer_used_bytes", "framebuffer the guest uses", lambda r: r["fb_used_bytes"]),
    ("vgpumgr_vgpu_framebuffer_total_bytes", "framebuffer of the vGPU's type", lambda r: r["fb_total_bytes"]),
    ("vgpumgr_vgpu_encoder_sessions", "NVENC sessions of the guest", lambda r: r["encoder"]["sessions"]),
    ("vgpumgr_vgpu_encoder_fps", "average NVENC frames per second", lambda r: r["encoder"]["fps"]),
    ("vgpumgr_vgpu_encoder_latency_seconds", "average NVENC latency", lambda r: r["encoder"]["latency_s"]),
    ("vgpumgr_vgpu_fbc_sessions", "frame buffer capture sessions of the guest", lambda r: r["fbc"]["sessions"]),
    ("vgpumgr_vgpu_fbc_fps", "average FBC frames per second", lambda r: r["fbc"]["fps"]),
    ("vgpumgr_vgpu_fbc_latency_seconds", "average FBC latency", lambda r: r["fbc"]["latency_s"]),
    ("vgpumgr_vgpu_frame_rate_limit_fps", "frame rate limit of the vGPU", lambda r: r["frame_rate_limit"]),
    ("vgpumgr_vgpu_licence_expiry_timestamp_seconds", "when the guest's licence expires",
     lambda r: r["licence"]["expiry"]),
    ("vgpumgr_vgpu_scheduler_share_ratio", "share of the GPU's time the vGPU scheduler gave the vGPU (its log, "
     "the last minute)", lambda r: (r.get("scheduler") or {}).get("share")),
    ("vgpumgr_vgpu_scheduler_expected_share_ratio", "share the scheduler's policy promises the vGPU (equal: 1/n "
     "running, fixed: by type; none for best effort)", lambda r: (r.get("scheduler") or {}).get("expected")),
)


def vendor_slice_metrics(inv: Any) -> Iterator[Metric]:
    """Other vendors' slices as sysfs sizes them (Ascend/Moore Threads mdev types, SR-IOV VFs with Intel's quotas or
    AMD's partition): memory per slice, and how many the driver offers now."""
    from vgpumgr.kinds import BACKEND_VF

    mem = GaugeMetricFamily("vgpumgr_vendor_slice_memory_bytes", "memory of one slice of a non-NVIDIA card, as its "
                            "driver gives it", labels=["gpu", "parent", "type"])
    avail = GaugeMetricFamily("vgpumgr_vendor_slices_available", "slices a non-NVIDIA card's driver offers now",
                              labels=["gpu", "type"])
    free: Counter[tuple[str, str]] = Counter()
    for t in inv.types:
        if not (t.backend == BACKEND_VF or t.type.startswith(("vnpu-", "mtgpu-"))) or t.gpu is None:
            continue
        if t.framebuffer_mb is not None:
            mem.add_metric([t.gpu, t.parent, t.type], t.framebuffer_mb << 20)
        free[(t.gpu, t.type)] += t.available_instances
    for (gpu, type_id), n in sorted(free.items()):
        avail.add_metric([gpu, type_id], n)
    yield mem
    yield avail


def _esc(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def telemetry_text(snap: dict[str, Any]) -> str:
    """The telemetry snapshot in Prometheus' text format (README "Metrics" lists the names). Written out here:
    prometheus_client's generic rendering took ~70 ms for a host of 256 vGPUs, more than a scrape may take."""
    out: list[str] = []

    def head(name: str, doc: str) -> None:
        out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")

    rows = [(r, ",".join(f'{k}="{_esc(r[k] or "")}"' for k in VGPU_LABELS) + ',source="host"')
            for r in snap["vgpus"]]
    guest = guest_rows(snap)
    head("vgpumgr_vgpu_utilization_ratio", "share of the engine's time this vGPU used (source: host = NVML on the "
         "host, guest = the vendor tool inside the VM, read through its guest agent)")
    for r, labels in rows:
        out.extend(f'vgpumgr_vgpu_utilization_ratio{{{labels},engine="{e}"}} {_num(v)}\n'
                   for e, v in r["util"].items() if v is not None)
    for d, labels in guest:
        out.extend(f'vgpumgr_vgpu_utilization_ratio{{{labels},engine="{e}"}} {_num(d["util"][k])}\n'
                   for k, e in (("gpu", "sm"), ("memory", "mem")) if d["util"].get(k) is not None)
    for name, doc, get in _VGPU_METRICS:
        head(name, doc)
        for r, labels in rows:
            v = get(r)
            if v is not None:
                out.append(f"{name}{{{labels}}} {_num(v)}\n")
        key = GUEST_FB.get(name)
        out.extend(f"{name}{{{labels}}} {d[key]}\n" for d, labels in guest if key and d.get(key) is not None)
    guest_state_text(snap, head, out)
    head("vgpumgr_vgpu_licence_state", "the guest's licence state as its driver reports it (1: current)")
    for r, labels in rows:
        out.extend(f'vgpumgr_vgpu_licence_state{{{labels},state="{st}"}} '
                   f'{"1.0" if r["licence"]["state"] == st else "0.0"}\n' for st in LICENCE_STATES)
    gpus = [(g, f'host="{_esc(g["host"])}",gpu="{g["gpu"]}"') for g in snap["gpus"]]
    head("vgpumgr_gpu_vgpu_utilization_ratio", "sum over the GPU's running vGPUs")
    for g, labels in gpus:
        if not g["absent"]:
            out.extend(f'vgpumgr_gpu_vgpu_utilization_ratio{{{labels},engine="{e}"}} {_num(v)}\n'
                       for e, v in g["util"].items())
    head("vgpumgr_gpu_vgpus_running", "vGPUs NVML reports running on the GPU")
    out.extend(f"vgpumgr_gpu_vgpus_running{{{labels}}} {g['vgpus']}\n" for g, labels in gpus if not g["absent"])
    head("vgpumgr_gpu_vgpu_framebuffer_used_bytes", "framebuffer its vGPUs use")
    out.extend(f"vgpumgr_gpu_vgpu_framebuffer_used_bytes{{{labels}}} {g['fb_used_bytes']}\n"
               for g, labels in gpus if not g["absent"])
    head("vgpumgr_gpu_free_slots", "vGPUs of the type the GPU could still take")
    for g, labels in gpus:
        if not g["absent"]:
            out.extend(f'vgpumgr_gpu_free_slots{{{labels},type="{_esc(t)}"}} {n}\n'
                       for t, n in g["free_slots"].items())
    head("vgpumgr_gpu_vgpu_telemetry_absent", "1: NVML gives no vGPU data for the GPU")
    out.extend(f"vgpumgr_gpu_vgpu_telemetry_absent{{{labels}}} 1.0\n" for g, labels in gpus if g["absent"])
    head("vgpumgr_telemetry_sample_timestamp_seconds", "when the vGPU sample was taken")
    out.append(f'vgpumgr_telemetry_sample_timestamp_seconds{{host="{_esc(snap["host"])}"}} {_num(snap["taken"])}\n')
    return "".join(out)


GUEST_FB = {"vgpumgr_vgpu_framebuffer_used_bytes": "memory_used_bytes",
            "vgpumgr_vgpu_framebuffer_total_bytes": "memory_total_bytes"}


def guest_rows(snap: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Each GPU a guest reported, with the labels of its VM's device (source="guest"); a GPU the guest listed
    that vgpumgr cannot bind to one of the VM's devices is named by its index in the guest."""
    out = []
    for g in snap.get("guests") or ():
        for d in g["gpus"]:
            values = {"host": g["host"], "gpu": d.get("gpu"), "vm": g["vm"], "vm_uuid": g["vm_uuid"],
                      "type": d.get("type"), "vgpu": d.get("vgpu") or f"guest:{d['index']}"}
            out.append((d, ",".join(f'{k}="{_esc(values[k] or "")}"' for k in VGPU_LABELS) + ',source="guest"'))
    return out


def guest_state_text(snap: dict[str, Any], head: Any, out: list[str]) -> None:
    guests = snap.get("guests") or ()
    head("vgpumgr_guest_telemetry_unknown", "1: the VM's guest-side reading is unknown, and why (no-agent, blocked, "
         "tool-missing, timed-out, refused, failed, pending)")
    for g in guests:
        if g["state"] != "ok":
            out.append(f'vgpumgr_guest_telemetry_unknown{{host="{_esc(g["host"])}",vm="{_esc(g["vm"])}",'
                       f'vm_uuid="{_esc(g["vm_uuid"] or "")}",reason="{_esc(g["reason"])}"}} 1.0\n')
    head("vgpumgr_guest_telemetry_read_timestamp_seconds", "when the VM's guest was last read")
    out.extend(f'vgpumgr_guest_telemetry_read_timestamp_seconds{{host="{_esc(g["host"])}",vm="{_esc(g["vm"])}",'
               f'vm_uuid="{_esc(g["vm_uuid"] or "")}"}} {_num(g["read_at"])}\n' for g in guests if g.get("read_at"))


class Metrics:
    def __init__(self, service: Service, sampler: Any | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(service))
        self.sampler = sampler
        self._rendered: tuple[float, bytes] = (-1.0, b"")  # telemetry text of the newest sample
        self.allocation_seconds = Histogram("vgpumgr_allocation_seconds", "time to place and create one vGPU",
                                            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.fleet_place_seconds = Histogram(
            "vgpumgr_fleet_place_seconds", "time GET /v1/fleet/place spends in its handler (the fleet's reads and "
            "ranking; not HTTP, authentication or JSON encoding), by result (placed: a host chosen; no_room: none can "
            "take it; error: the service refused the request)", ["host", "result"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.fleet_publish_seconds = Histogram(
            "vgpumgr_fleet_publish_seconds", "time inside this process's publisher per publish of the host's "
            "capacity, by kind (change: what a change moved, in its transaction; heartbeat: what changed since the "
            "last; full: every row rewritten, as at start, on `fleet publish` and every tenth heartbeat)",
            ["host", "kind"], buckets=PUBLISH_BUCKETS, registry=self.registry)
        self.host = service.hostname  # labelled as the per-vGPU series are, for the dashboards' host filter
        for result in PLACE_RESULTS:  # every series exists from the start, at zero
            self.fleet_place_seconds.labels(host=self.host, result=result)
        for kind in PUBLISH_KINDS:
            self.fleet_publish_seconds.labels(host=self.host, kind=kind)
        service.fleet.observe = self.observe_publish

    def observe_allocation(self, seconds: float) -> None:
        self.allocation_seconds.observe(seconds)

    def observe_fleet_place(self, seconds: float, result: str) -> None:
        self.fleet_place_seconds.labels(host=self.host, result=result).observe(seconds)

    def observe_publish(self, seconds: float, kind: str) -> None:
        self.fleet_publish_seconds.labels(host=self.host, kind=kind).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry) + self._telemetry()

    def _telemetry(self) -> bytes:
        if self.sampler is None:
            return b""
        try:
            snap = self.sampler.latest()
            if self._rendered[0] != snap["taken"]:  # one rendering per sample, whatever the scrape rate
                self._rendered = (snap["taken"], telemetry_text(snap).encode())
            return self._rendered[1]
        except Exception:  # a scrape must not fail because NVML did
            log.exception("collecting vGPU telemetry failed")
            return b""
