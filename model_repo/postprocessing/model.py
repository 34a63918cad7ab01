"""Triton Python model: a window of generated ids → the text its new tokens add, never as broken UTF-8; passes
the statistics through. Stateless: each response carries the few already-shown tokens detokenisation needs."""

import numpy as np
import triton_python_backend_utils as pb_utils

from specdeploy.text import new_text
from specdeploy.triton.model_files import load_tokenizer
from specdeploy.triton.requests import STATISTICS, error_response, one_row, required

INPUTS = ("output_ids", "previous_length", *(name for name, *_ in STATISTICS))


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = {name: tensor.as_numpy() for name in INPUTS
                          if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None}
                window = one_row(required(inputs.get("output_ids"), "output_ids"), "output_ids")
                shown = int(required(inputs.get("previous_length"), "previous_length").reshape(-1)[0])
                text = new_text(self.tokenizer, window, shown)
                outputs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
                for name, *_ in STATISTICS:
                    outputs.append(pb_utils.Tensor(name, required(inputs.get(name), name)))
                responses.append(pb_utils.InferenceResponse(outputs))
            except Exception as exc:  # one error response per bad request, never a traceback
                responses.append(error_response(pb_utils, exc))
        return responses
