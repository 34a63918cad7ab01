"""User-facing errors. Each message names what was wrong and, where it helps, what is allowed."""


class SpecdeployError(Exception):
    """Base class: the CLI prints the message and exits non-zero instead of a traceback."""


class PipelineError(SpecdeployError):
    """A pipeline YAML is malformed or invalid (the message names the file and the key path)."""


class BuildError(SpecdeployError):
    """An engine could not be built from the pipeline's checkpoints."""


class RequestError(SpecdeployError):
    """A generation request is invalid (the message names the request field)."""


class ShuttingDown(SpecdeployError):
    """The server is draining: it takes no new requests (Triton's UNAVAILABLE), and ends what is still running at
    the drain's deadline."""


class SchedulerFailed(ShuttingDown):
    """The serving loop stopped on an unexpected exception: it failed every request it held and takes no new ones
    (UNAVAILABLE: another replica, or this one once restarted, can serve them). The message names the failure."""
