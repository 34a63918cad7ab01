"""Triton Python model: text_input → token ids, with the chat template. Thin: logic in specdeploy."""

import numpy as np
import triton_python_backend_utils as pb_utils

from specdeploy.serve.model_files import load_tokenizer
from specdeploy.serve.requests import encode_request, error_response


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input")
                ids = encode_request(self.tokenizer, None if text is None else text.as_numpy())
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))]))
            except Exception as exc:  # one error response per bad request, never a traceback
                responses.append(error_response(pb_utils, exc))
        return responses
