"""Prometheus metrics of the daemon (`GET /metrics`), read from its state at each scrape.

Per GPU: memory, SMACT/SMOCC/DRAMA, power, the energy counter, temperature, whether the risk filter
excludes it, its tasks. A metric the GPU cannot report is left out for that GPU, never exported as 0.
Tasks: how many are in each state, the queue lengths, and counters of ended tasks by outcome, OOM
crashes and recoveries. The scheduler's decision latency is a histogram.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from carma.core.ports import Clock
from carma.core.scheduler import Scheduler
from carma.core.types import TERMINAL_STATES, Task, TaskState
from carma.server.mig import MigManager
from carma.server.store import Store

MIB = 1 << 20
DECISION_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
# (metric name, help, attribute of the latest sample, scale)
GPU_GAUGES = (
    ("carma_gpu_memory_used_bytes", "GPU memory in use", "used_mib", MIB),
    ("carma_gpu_memory_total_bytes", "Total GPU memory", "total_mib", MIB),
    ("carma_gpu_sm_active_ratio", "SMACT: fraction of time SMs had a warp resident", "smact", 1),
    ("carma_gpu_sm_occupancy_ratio", "SMOCC: resident warps over the maximum", "smocc", 1),
    ("carma_gpu_dram_active_ratio", "DRAMA: fraction of cycles the memory interface was busy", "drama", 1),
    ("carma_gpu_graphics_active_ratio", "GRACT: fraction of time any kernel ran", "gract", 1),
    ("carma_gpu_power_watts", "GPU power draw", "power_w", 1),
    ("carma_gpu_temperature_celsius", "GPU temperature", "temperature_c", 1),
)
LABELS = ("gpu", "name", "uuid")


class MetricsSource(Protocol):
    """What the metrics read of the daemon. A protocol rather than the `Daemon` class: the daemon imports
    this module (for `counted` and the histogram), so this module must not import the daemon back."""

    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def store(self) -> Store: ...
    @property
    def decision_seconds(self) -> Histogram: ...
    @property
    def mig(self) -> MigManager | None: ...


def decision_histogram() -> Histogram:
    """The scheduler's decision latency, observed by the scheduling loop (registered by `Metrics`).

    Without the `carma_decision_seconds_created` series prometheus_client adds by default (a setting of the
    whole process, the daemon's): a gauge of when the daemon made the histogram, undocumented and a family of
    its own in the text format."""
    disable_created_metrics()
    return Histogram(
        "carma_decision_seconds", "Time one scheduling decision took", buckets=DECISION_BUCKETS, registry=None
    )


class DaemonCollector(Collector):
    def __init__(self, daemon: MetricsSource) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self._daemon
        statuses = d.scheduler.gpu_status(d.clock.now())
        gauges = {name: GaugeMetricFamily(name, doc, labels=LABELS) for name, doc, _, _ in GPU_GAUGES}
        energy = CounterMetricFamily("carma_gpu_energy_joules", "GPU energy counter", labels=LABELS)
        excluded = GaugeMetricFamily(
            "carma_gpu_risk_excluded", "1 when the risk filter keeps the GPU out of collocation", labels=LABELS
        )
        tasks_on = GaugeMetricFamily("carma_gpu_tasks", "carma tasks placed on the GPU", labels=LABELS)
        for index, status in enumerate(statuses):  # `gpu` is its position in `carma gpus`, `uuid` its id
            labels = [str(index), status.gpu.name, status.gpu.id]
            sample = status.latest
            if sample is not None:
                for name, _, attribute, scale in GPU_GAUGES:
                    value = getattr(sample, attribute)
                    if value is not None:
                        gauges[name].add_metric(labels, value * scale)
                if sample.energy_j is not None:
                    energy.add_metric(labels, sample.energy_j)
            excluded.add_metric(labels, float(status.excluded))
            tasks_on.add_metric(labels, len(status.tasks))
        yield from gauges.values()
        yield from (energy, excluded, tasks_on)
        yield from _task_metrics(d)


def counted(tasks: Iterable[Task]) -> Counter[str]:
    """What the counters count of these tasks: the ended ones by outcome, OOM crashes, recoveries. The
    daemon keeps these sums for the tasks it forgets, so its counters never go down."""
    counts: Counter[str] = Counter()
    for task in tasks:
        if task.terminal:
            counts[task.state.value] += 1
        counts["oom_crashes"] += sum(a.out_of_memory for a in task.attempts)
        counts["recovered"] += task.state is TaskState.COMPLETED and any(a.recovery for a in task.attempts)
    return counts


def _task_metrics(d: MetricsSource) -> Iterator[Metric]:
    tasks = d.scheduler.tasks
    by_state = Counter(task.state for task in tasks)
    states = GaugeMetricFamily("carma_tasks", "Tasks by state", labels=["state"])
    for state in TaskState:
        states.add_metric([state.value], by_state[state])
    queues = GaugeMetricFamily("carma_queue_length", "Tasks waiting, by queue", labels=["queue"])
    queues.add_metric(["fifo"], len(d.scheduler.queue))
    queues.add_metric(["recovery"], len(d.scheduler.recovery_queue))
    totals = counted(tasks) + Counter(d.store.forgotten())
    ended = CounterMetricFamily("carma_tasks_ended", "Tasks that ended, by outcome", labels=["outcome"])
    for state in (s for s in TaskState if s in TERMINAL_STATES):
        ended.add_metric([state.value], totals[state.value])
    yield from (states, queues, ended)
    yield CounterMetricFamily("carma_oom_crashes", "Attempts that ended out of memory", value=totals["oom_crashes"])
    yield CounterMetricFamily(
        "carma_tasks_recovered", "Tasks completed after an OOM relaunch", value=totals["recovered"]
    )
    if d.mig is not None:
        mig = CounterMetricFamily(
            "carma_mig_reconfigurations", "MIG reconfigurations since the start, by outcome", labels=["outcome"]
        )
        mig.add_metric(["done"], d.mig.reconfigurations)
        mig.add_metric(["refused"], d.mig.refused)
        yield mig


class Metrics:
    """The registry behind `/metrics`: the daemon's state plus its decision-latency histogram."""

    def __init__(self, daemon: MetricsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(daemon))
        self.registry.register(daemon.decision_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
