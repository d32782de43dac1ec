"""The replicas in /metrics: how many run per model against how many should, and each replica's own queue and work.

The rest of /metrics needs nothing new behind replicas: the ingress sees every HTTP request and completion, the
engine gauges add up every replica's stats, and the step histograms are fed every replica's steps (RemoteEngine).
Read at scrape time from the snapshots that the /metrics route's refresh has just fetched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.cluster.remote_engine import RemoteEngine

PER_REPLICA = (
    ("tokenmill_replica_running_sequences", "Sequences in a replica's running batch", "num_running"),
    ("tokenmill_replica_waiting_sequences", "Sequences waiting in a replica's scheduler", "num_waiting"),
    ("tokenmill_replica_kv_blocks_used", "KV-cache blocks in use in a replica", "num_used_blocks"),
)


class ReplicaCollector:
    def __init__(self, engines: Sequence[RemoteEngine]) -> None:
        self.engines = engines

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        running, target, retries, dropped, info, tokens, *gauges = families = self._families()
        for engine in self.engines:
            model = engine.model_name
            running.add_metric([model], engine.running_replicas)
            target.add_metric([model], engine.target_replicas)
            retries.add_metric([model], engine.retries)
            dropped.add_metric([model], engine.steps_dropped)
            for snapshot in engine.snapshots:
                labels = [model, snapshot.replica]
                info.add_metric([*labels, str(snapshot.pid)], 1)
                tokens.add_metric(labels, snapshot.stats.tokens_computed)
                for family, (_, _, field) in zip(gauges, PER_REPLICA):
                    family.add_metric(labels, getattr(snapshot.stats, field))
        return families

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        per_model, per_replica = ["model"], ["model", "replica"]
        return [
            GaugeMetricFamily("tokenmill_replicas", "Engine replicas answering, per model", labels=per_model),
            GaugeMetricFamily(
                "tokenmill_replicas_target", "Engine replicas that should be running, per model", labels=per_model
            ),
            CounterMetricFamily(
                "tokenmill_replica_retries",
                "Prompts sent again because their replica died before answering",
                labels=per_model,
            ),
            CounterMetricFamily(
                "tokenmill_replica_steps_dropped",
                "Engine steps a replica could not keep until a scrape (missing from the step histograms)",
                labels=per_model,
            ),
            GaugeMetricFamily(
                "tokenmill_replica_info", "1 per replica answering, with its process id", labels=[*per_replica, "pid"]
            ),
            CounterMetricFamily(
                "tokenmill_replica_tokens_computed", "Tokens a replica's engine computed", labels=per_replica
            ),
            *(GaugeMetricFamily(name, doc, labels=per_replica) for name, doc, _ in PER_REPLICA),
        ]
