"""Triton Python model `drain_hold`: keeps the models loaded while `specdeploy serve` drains (serve/drain_hold.py).

Triton unloads every model as soon as no model has an inference in flight, and a decoupled model's streams do not
count, so during a drain the `speculative` model would be unloaded under its running streams and new requests would
get NOT_FOUND ("unknown model"). A sequence open on this model counts as in flight, so Triton keeps the models
loaded (and its stopped schedulers answer new requests UNAVAILABLE) until the launcher ends the sequence. The model
itself does nothing: each request gets an empty answer.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("held", np.array([[True]]))]) for _ in requests]
