"""Triton Python model (decoupled), the torch flavour's `speculative`: owns draft and target and runs
continuous-batched speculative decoding.

Each request joins the scheduler; every step's tokens go back as a response (streaming) or once at the end.
Thin: the engine, the scheduler, the validation and the metrics live in specdeploy.
"""

import json

import triton_python_backend_utils as pb_utils

from specdeploy.serve.model_files import ENGINE_PARAMETER, parameter_path
from specdeploy.serve.served_model import ServedModel
from specdeploy.serve.torch.server import TorchServer, instance_device, stop_parent_tritonserver


class TritonPythonModel(ServedModel):
    def initialize(self, args):
        name = json.loads(args["model_config"])["name"]
        self.server = TorchServer(parameter_path(args, ENGINE_PARAMETER), name, pb_utils, instance_device(args),
                                  stop_parent_tritonserver)
