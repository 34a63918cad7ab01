"""Triton Python model standing in for the `tensorrtllm` backend (see tensorrtllm_double.py beside it). The test
copies both files into a trtllm repository's tensorrt_llm/1 and tensorrt_llm_draft/1, keeps the generated config's
tensors and parameters, sets backend "python" and adds `double_component`: the torch engine component to run. The
parameters are read as the backend's model instance reads them: a config it would refuse fails to load here too,
with its message."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tensorrtllm_double import DoubleError, TensorrtllmDouble, responses


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config["parameters"].items()}
        self.double = TensorrtllmDouble.load(parameters["double_component"], parameters)
        self.names = [tensor["name"] for tensor in config["input"]]

    def execute(self, requests):
        # A request's tensors are read here: they are not the thread's to read after execute returns.
        for request in requests:
            inputs = {name: tensor.as_numpy().copy() for name in self.names
                      if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None}
            threading.Thread(target=self.answer, args=(request.get_response_sender(), inputs), daemon=True).start()
        return None

    def answer(self, sender, inputs):
        streaming = bool(inputs.get("streaming", np.zeros(1)).reshape(-1)[0])
        try:
            for step in responses(self.double.run(inputs), streaming):
                outputs = [pb_utils.Tensor("output_ids", np.array([[step.tokens]], dtype=np.int32)),
                           pb_utils.Tensor("sequence_length", np.array([[len(step.tokens)]], dtype=np.int32))]
                if step.logits is not None:
                    outputs.append(pb_utils.Tensor("generation_logits", step.logits[None, None].astype(np.float32)))
                sender.send(pb_utils.InferenceResponse(outputs))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except DoubleError as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # a bug in the double: reported to the caller, not swallowed
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"double: {exc!r}")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
