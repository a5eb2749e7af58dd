"""Replicas: this replica's heartbeat and homes (replica), the directory in Redis, the
hand-off of a request to its conversation's home, and `pensieve cluster` with HAProxy."""
