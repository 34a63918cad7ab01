"""The trtllm flavour's `speculative` Triton model: requests in, the orchestration (orchestration.py) over the
`tensorrtllm` backend's models through BLS, responses and Prometheus metrics out. It loads no weights: the
pipeline and the target's tokenizer and config.json are files in its version directory. `pb_utils` is passed in."""

from __future__ import annotations

import os
from pathlib import Path

from specdeploy.decoding.chat_template import end_of_sequence_ids
from specdeploy.decoding.light_tokenizer import load_tokenizer_files
from specdeploy.serve.model_files import model_vocabulary
from specdeploy.serve.served_model import DrainWatcher, Metrics, submit_request
from specdeploy.serve.trtllm.engine_calls import BlsCalls
from specdeploy.serve.trtllm.orchestration import UNCHECKED_MEDUSA_SAMPLING, Orchestrator
from specdeploy.spec.pipeline import load_pipeline


class TrtllmServer:
    def __init__(self, pipeline_file: Path, target_dir: Path, target_model: str, draft_model: str | None,
                 model_name: str, pb_utils) -> None:
        """pipeline_file: the served pipeline (pipeline.json); target_dir: the target's tokenizer and config.json;
        target_model / draft_model: the tensorrtllm models' names (draft_model None: no draft engine)."""
        self.pb = pb_utils
        self.pipeline = load_pipeline(pipeline_file)
        self.tokenizer = load_tokenizer_files(target_dir)
        vocab_size, eos_ids = model_vocabulary(target_dir)  # its vocabulary and end ids (the build checked the rest)
        method = self.pipeline.speculation.method
        # trtllm-check's Medusa distribution arm alone sets it (orchestration.check_medusa_request says why)
        unchecked = os.environ.get(UNCHECKED_MEDUSA_SAMPLING) == "1"
        self.metrics = Metrics(pb_utils, {"model": model_name, "method": method})
        self.orchestrator = Orchestrator(self.pipeline, BlsCalls(pb_utils, target_model, draft_model),
                                         vocab_size, end_of_sequence_ids(self.tokenizer, eos_ids),
                                         on_change=self._on_change, tokenizer=self.tokenizer,
                                         unchecked_medusa_sampling=unchecked)
        self._on_change(self.orchestrator)  # the gauges start at their idle values, not at 0
        self.watcher = DrainWatcher(self.orchestrator)
        pb_utils.Logger.log_info(f"specdeploy: orchestrating {target_model}" + (f" and {draft_model}" if draft_model
                                 else "") + f" ({method}, gamma {self.pipeline.speculation.num_draft_tokens})")
        if self.orchestrator.unchecked_sampling:
            pb_utils.Logger.log_warn(f"specdeploy: {UNCHECKED_MEDUSA_SAMPLING}=1: sampled Medusa requests reach the "
                                     f"engine, whose sampling is not exact (a check's setting, not a server's)")

    def _on_change(self, orchestrator: Orchestrator) -> None:
        if hasattr(self, "metrics"):
            self.metrics.update(*orchestrator.snapshot())

    def stop(self) -> None:
        self.watcher.stop()
        self.orchestrator.stop()

    def submit(self, request) -> None:
        submit_request(self.pb, request, self.tokenizer, self.pipeline, self.tokenizer, self.orchestrator,
                       self.metrics)
