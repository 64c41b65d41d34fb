"""Read one sample from a running server's GET /metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """The value of the sample `name` with these labels (0 when absent)."""
    with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
