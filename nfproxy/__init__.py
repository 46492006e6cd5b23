"""nfproxy: a Kubernetes service proxy with nftables and iptables backends compiled from one model."""

__version__ = "0.1.0"
