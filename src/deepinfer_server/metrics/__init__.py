"""Metrics: the Prometheus registry of one server and the per-request records it observes."""

from deepinfer_server.metrics.histogram import FastHistogram
from deepinfer_server.metrics.records import ChoiceRecords, RequestRecord
from deepinfer_server.metrics.registry import CONTENT_TYPE, PREFIX, RankLoad, ServerMetrics

__all__ = [
    "CONTENT_TYPE",
    "PREFIX",
    "ChoiceRecords",
    "FastHistogram",
    "RankLoad",
    "RequestRecord",
    "ServerMetrics",
]
