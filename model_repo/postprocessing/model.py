"""Triton Python model: generated ids → text, incrementally and never as broken UTF-8; passes statistics through."""

import numpy as np
import triton_python_backend_utils as pb_utils

from specdeploy.detokenize import new_text
from specdeploy.triton.requests import STATISTICS, model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1).tolist()
            before = int(pb_utils.get_input_tensor_by_name(request, "previous_length").as_numpy().reshape(-1)[0])
            text = new_text(self.tokenizer, ids, before)
            outputs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
            for name, *_ in STATISTICS:
                outputs.append(pb_utils.Tensor(name, pb_utils.get_input_tensor_by_name(request, name).as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
