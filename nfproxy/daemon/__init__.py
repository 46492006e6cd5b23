"""The node daemon: the sync loop, its servers, health, metrics, conntrack policy
and cleanup."""
