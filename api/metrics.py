"""Prometheus metrics: GPUs, vGPUs by type and state, licence seats per edition, allocation latency.

Gauges are read at scrape time from the inventory snapshot and the database, so they are never stale;
each app has its own registry (several apps in one test process do not collide).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

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


class Metrics:
    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(service))
        self.allocation_seconds = Histogram("vgpumgr_allocation_seconds", "time to place and create one vGPU",
                                            buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_allocation(self, seconds: float) -> None:
        self.allocation_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
