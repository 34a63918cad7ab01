"""Triton Python model (decoupled), the trtllm flavour's `speculative`: orchestrates speculative decoding over the
tensorrtllm backend's models (tensorrt_llm, tensorrt_llm_draft) through BLS, with streaming, the batch-aware
policy, exact acceptance and the specdeploy_* metrics. Thin: the logic lives in specdeploy.serve."""

import json

import triton_python_backend_utils as pb_utils

from specdeploy.serve.model_files import (
    DRAFT_MODEL_PARAMETER,
    PIPELINE_PARAMETER,
    TARGET_MODEL_PARAMETER,
    TOKENIZER_PARAMETER,
    parameter_path,
)
from specdeploy.serve.served_model import ServedModel
from specdeploy.serve.trtllm.server import TrtllmServer


class TritonPythonModel(ServedModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config["parameters"].items()}
        self.server = TrtllmServer(parameter_path(args, PIPELINE_PARAMETER), parameter_path(args, TOKENIZER_PARAMETER),
                                   parameters[TARGET_MODEL_PARAMETER], parameters[DRAFT_MODEL_PARAMETER] or None,
                                   config["name"], pb_utils)
