"""How a request ended: one of five reasons, with any detail kept apart from the reason itself."""

from __future__ import annotations

from enum import StrEnum


class Finish(StrEnum):
    """A request's finish reason; its value is the `outcome` label of specdeploy_requests_total.

    STOP: an end token, a stop sequence or a stop string; LENGTH: max_tokens reached; CANCELLED: by the client or
    the serving loop; ERROR: a failed step or engine call (the detail says what failed); SHUTDOWN: the server
    drained before the request started or finished."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    SHUTDOWN = "shutdown"

    @property
    def is_failure(self) -> bool:
        """The request did not run to its own end: the client gets an error, not a final response."""
        return self in (Finish.ERROR, Finish.SHUTDOWN)


def finish_message(reason: Finish, detail: str = "") -> str:
    """The reason with its detail, as an error response or a log line shows it ("error: ...")."""
    return f"{reason.value}: {detail}" if detail else reason.value
