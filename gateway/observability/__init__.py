"""What the gateway reports about itself: Prometheus metrics and structured logs."""
