"""Keep tritonserver's models loaded while it drains, so that new requests get UNAVAILABLE, not NOT_FOUND.

On SIGTERM Triton turns not ready, stops every model's scheduler (new requests then get UNAVAILABLE "Server is
stopping") and unloads all models as soon as none has an inference in flight (core's InferenceServer::Stop). A
decoupled model's running streams are not in flight to Triton once its execute() has returned, so without more
the models are unloaded at once, and a request for an unloading model gets NOT_FOUND "has no available versions",
a code that retry policies and load balancers take as permanent. An open sequence on a model with Triton's
sequence batcher is in flight (it lets a sequence finish while the server stops), so the launcher opens one on the
`drain_hold` model just before SIGTERM and ends it once the `speculative` model reports its scheduler idle, or at
the drain's deadline. The sequence is renewed every RENEW seconds: the model's idle timeout (SEQUENCE_IDLE_S)
releases a sequence nobody renews, so neither a dead launcher nor a stray client holds a stopping server for
long.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

HOLD_MODEL = "drain_hold"
SEQUENCE_IDLE_S = 5  # the model's max_sequence_idle: Triton drops a sequence not renewed within it
RENEW = 1.0  # seconds between the launcher's renewals
POLL = 0.1  # seconds between looks at done()


class DrainHold:
    """An open sequence on `drain_hold` at `url` (gRPC): begin() opens it (before SIGTERM, while the model still
    takes new sequences), a thread renews it until `done()` or `deadline` (time.time()), then ends it."""

    def __init__(self, url: str, deadline: float, done: Callable[[], bool]) -> None:
        self.url = url
        self.deadline = deadline
        self.done = done
        self.sequence = secrets.randbits(63) or 1  # Triton takes any non-zero id
        self.thread = threading.Thread(target=self._hold, name="specdeploy-drain-hold", daemon=True)

    def _send(self, client, start: bool = False, end: bool = False) -> None:
        import tritonclient.grpc as grpcclient

        hold = grpcclient.InferInput("hold", [1, 1], "BOOL")
        hold.set_data_from_numpy(np.array([[True]]))
        client.infer(HOLD_MODEL, [hold], sequence_id=self.sequence, sequence_start=start, sequence_end=end,
                     client_timeout=5)

    def begin(self) -> bool:
        """Open the sequence and start renewing it. False (nothing held) when the server does not answer."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.client = grpcclient.InferenceServerClient(self.url)
        try:
            self._send(self.client, start=True)
        except InferenceServerException:
            self.client.close()
            return False
        self.thread.start()
        return True

    def _hold(self) -> None:
        from tritonclient.utils import InferenceServerException

        renewed = time.monotonic()
        try:
            # past the deadline the model ends what still runs at once: one more renewal covers that
            while not self.done() and time.time() < self.deadline + RENEW:
                time.sleep(POLL)
                if time.monotonic() - renewed >= RENEW:
                    self._send(self.client)
                    renewed = time.monotonic()
            self._send(self.client, end=True)
        except InferenceServerException:
            pass  # the server is gone or dropped the sequence: nothing is held any more
        finally:
            self.client.close()
