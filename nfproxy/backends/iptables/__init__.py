"""The iptables backend: pure, state in, restore payloads out."""
