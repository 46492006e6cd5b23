"""The command line: flags and configuration, one module per command."""
