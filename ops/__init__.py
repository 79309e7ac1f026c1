"""Operator commands: tail logs, hot-swap an actor kind, change live configuration, status; and the generated
pages of the documentation site (ops.docs)."""
