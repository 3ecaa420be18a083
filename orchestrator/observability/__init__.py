"""What a run tells people: event lines, Prometheus metrics, per-step accounting, run records, reports."""
