"""Prometheus exposition (`GET /metrics`): what an operator graphs and alerts on.

Gauges are read at scrape time (a GROUP BY over small tables, the writer's queue, the hub's
clients), so nothing is maintained on the hot paths but two counters. Each app has its own
registry: several apps in one process (tests) must not share series.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select

from server.models import Agent, Alert, Job
from tokenpulse.protocol import AlertKind, JobState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
AGENT_STATES = ("online", "lost", "offline")
ALERT_KINDS = frozenset(v for k, v in vars(AlertKind).items() if k.isupper() and isinstance(v, str))
SEVERITIES = ("info", "warning", "critical")


@dataclass
class ServerStats:
    """Counters bumped where the work happens (the agent routes)."""
    ingested_points: int = 0  # metric points stored
    ingested_events: int = 0  # every stored event, metric points included
    agent_socket_messages: int = 0  # heartbeats and event batches that came over agent websockets


class Collector:
    def __init__(self, tp):
        self.tp = tp

    def collect(self):
        tp = self.tp
        with tp.db.read() as s:
            jobs = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
            agents = dict(s.execute(select(Agent.state, func.count()).group_by(Agent.state)).all())
            alerts = s.execute(select(Alert.kind, Alert.severity, func.count())
                               .where(Alert.state == "open").group_by(Alert.kind, Alert.severity)).all()
        g = GaugeMetricFamily("tokenpulse_jobs", "Jobs by state", labels=["state"])
        for st in JobState:
            g.add_metric([st.value], jobs.get(st.value, 0))
        yield g
        g = GaugeMetricFamily("tokenpulse_agents", "Agents by state", labels=["state"])
        for st in AGENT_STATES:
            g.add_metric([st], agents.get(st, 0))
        yield g
        # Label values come from fixed sets: a script's own alert kinds (any string, thousands of
        # them) would each be a series; they are counted as "other".
        counts: Counter = Counter()
        for kind, severity, n in alerts:
            counts[(kind if kind in ALERT_KINDS else "other", severity if severity in SEVERITIES else "other")] += n
        g = GaugeMetricFamily("tokenpulse_open_alerts", "Open alerts by kind and severity", labels=["kind", "severity"])
        for (kind, severity), n in sorted(counts.items()):
            g.add_metric([kind, severity], n)
        yield g
        yield CounterMetricFamily("tokenpulse_ingested_points", "Metric points stored",
                                  value=tp.stats.ingested_points)
        yield CounterMetricFamily("tokenpulse_ingested_events", "Events stored (metric points included)",
                                  value=tp.stats.ingested_events)
        yield CounterMetricFamily("tokenpulse_agent_socket_messages",
                                  "Heartbeats and event batches received over agent websockets",
                                  value=tp.stats.agent_socket_messages)
        yield GaugeMetricFamily("tokenpulse_write_queue_depth", "Writes waiting for the database writer thread",
                                value=tp.db.queue_depth())
        yield GaugeMetricFamily("tokenpulse_websocket_clients", "Connected websocket clients",
                                value=tp.hub.client_count())


def exposition(tp) -> bytes:
    registry = getattr(tp, "_prometheus_registry", None)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(tp))
        tp._prometheus_registry = registry
    return generate_latest(registry)
