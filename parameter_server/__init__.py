"""Parameter-server shards and their worker-side client (see DESIGN.md; built by the parameter-server issue)."""
