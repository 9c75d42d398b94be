"""What the scheduler shows of itself: Prometheus metrics and request traces."""
