"""The functional core: the service model, endpoint categorisation and change
tracking. It imports nothing else of nfproxy."""
