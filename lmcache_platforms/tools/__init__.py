"""Operational tools run from the command line (never imported by the connector): soak runs."""
