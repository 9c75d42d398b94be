"""The executor's edge: the gRPC servicer, its lease, the runner protocol, metrics and step traces."""
