"""Generated gRPC stubs for the controller's control API (see README.md to regenerate)."""
