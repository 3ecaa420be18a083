"""One rank's training state and where it goes: DCP checkpoints, in-memory snapshots and their replicas."""
