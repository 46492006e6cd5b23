"""The nftables backend: pure, state in, rule objects and transactions out."""
