"""What a rank measures or is made to suffer on purpose: memory probes, timelines, injected faults."""
