"""Pure renderers: ClusterState in, structured rules (and their text) out."""
