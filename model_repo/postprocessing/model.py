"""Triton Python model: a window of generated ids → the text its new tokens add, never as broken UTF-8; passes
the statistics through. Stateless: each response carries the few already-shown tokens detokenisation needs."""

import numpy as np
import triton_python_backend_utils as pb_utils

from specdeploy.text import new_text
from specdeploy.triton.model_files import load_tokenizer
from specdeploy.triton.requests import STATISTICS


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            window = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1).tolist()
            shown = int(pb_utils.get_input_tensor_by_name(request, "previous_length").as_numpy().reshape(-1)[0])
            text = new_text(self.tokenizer, window, shown)
            outputs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
            for name, *_ in STATISTICS:
                outputs.append(pb_utils.Tensor(name, pb_utils.get_input_tensor_by_name(request, name).as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
