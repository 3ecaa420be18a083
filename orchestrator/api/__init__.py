"""The job's remote faces: the authenticated gRPC control server inside a run, and the `Client` that talks to it."""
