"""The job's remote face: the authenticated gRPC control server inside a run, and the tokens every raymesh server
checks. The `Client` that talks to it is `orchestrator.client`, a layer up: it also finds and starts controllers."""
