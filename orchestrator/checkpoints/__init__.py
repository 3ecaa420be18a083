"""Checkpoint bookkeeping on the controller side: directory naming and retention, checksum manifests."""
