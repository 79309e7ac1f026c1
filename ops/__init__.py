"""Operator commands: tail logs, hot-swap an actor kind, change live configuration, status."""
