"""`python -m nfproxy.cli`: the same as the `nfproxy` command."""

from nfproxy.cli.exit import entry

entry()
