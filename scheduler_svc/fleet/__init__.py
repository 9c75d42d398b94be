"""The executors: discovery, heartbeats and leases, who drives which, routing new requests."""
