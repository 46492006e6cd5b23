"""Verification tools: compare, validate, the lab, the traffic sandbox and its
statistics."""
