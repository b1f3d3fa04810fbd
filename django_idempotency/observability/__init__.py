"""What the app tells the outside about itself: Prometheus metrics (``metrics.py``, from the
signals) and OpenTelemetry spans (``tracing.py``). Both optional, both off unless set."""

__all__: list[str] = []
