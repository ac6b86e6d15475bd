"""Health: active probes, and (later) passive outlier detection and circuit breakers."""
