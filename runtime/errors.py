"""The runtime's exception hierarchy; each subclasses the builtin a caller would catch."""


class RuntimeFailure(RuntimeError):
    """The run cannot continue (restart intensity exceeded, bus unreachable)."""


class BusError(ConnectionError):
    """The NATS server could not be started, reached or configured, or refused a request."""


class BusTimeout(BusError, TimeoutError):
    """A request or flush got no answer within its timeout (the responder is slow, wedged or gone)."""


class NoResponders(BusError):
    """A request's subject has no subscriber: nobody is there to answer (not started, or stopped)."""


class RevisionMismatch(ValueError):
    """A KV write's expected revision was not the key's: it exists (create) or changed since it was read."""


class MessageError(ValueError):
    """A message could not be decoded or validated; ``reason`` is a stable short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class WorkDropped(RuntimeError):
    """A handler's word that its message is work the run no longer wants done (the trainer is past the run's step
    budget): the base acks it and says so at info (``work_dropped``); not a failure to retry, nor a dead letter,
    which is for what nobody can handle. Whoever ordered the work keeps its own record of it (the reconciler's
    table) and orders it again if it is ever wanted (a resumed run)."""


class ConfigError(ValueError):
    """A configuration key is unknown, malformed or out of range; the message names the key."""


class ActorFailed(RuntimeError):
    """An actor met a fault it cannot recover from in-process; its process exits non-zero with this reason."""


class LifecycleError(RuntimeError):
    """A lifecycle step was called in the wrong state."""
