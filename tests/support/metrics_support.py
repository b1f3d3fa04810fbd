"""Reading Prometheus samples back from the default registry in tests."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import REGISTRY

#: A name for each sample to watch: (metric sample name, labels).
Samples = Mapping[str, tuple[str, dict[str, str]]]


class SampleDelta:
    """Every watched sample's change since this object was created."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.start = self.read()

    def read(self) -> dict[str, float]:
        return {
            name: REGISTRY.get_sample_value(metric, labels) or 0.0
            for name, (metric, labels) in self.samples.items()
        }

    def delta(self) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - self.start[name] for name in now if now[name] != self.start[name]}
