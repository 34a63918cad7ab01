"""The torch flavour's `speculative` Triton model: requests in, the continuous-batching scheduler over our torch
engine, responses and Prometheus metrics out. `pb_utils` is passed in, so this module imports without a server."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from specdeploy.decoding.light_tokenizer import load_tokenizer_files
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.fault_injection import inject_from_environment
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.serve.model_files import FAILURE_FILE_VARIABLE
from specdeploy.serve.served_model import DrainWatcher, Metrics, submit_request
from specdeploy.spec.engine_paths import engine_pipeline


def instance_device(args: dict) -> str:
    """The torch device of the Triton model instance `args` describes: a KIND_GPU instance runs on its GPU."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{args['model_instance_device_id']}"
    return "cpu"


def stop_parent_tritonserver() -> None:
    """SIGTERM to the tritonserver that runs this Python-backend stub (its parent): Triton turns not ready at once,
    refuses new requests, unloads the models and exits. Nothing is sent when the parent is anything else."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return
    if name == "tritonserver":
        os.kill(parent, signal.SIGTERM)


class TorchServer:
    def __init__(self, engine_dir: Path, model_name: str, pb_utils, device: str = "cpu",
                 stop_server: Callable[[], None] | None = None) -> None:
        """engine_dir: the engine this model serves; everything else (limits, defaults, policy) comes from the
        pipeline saved in it. device: where this instance runs (instance_device). stop_server: what stops the server
        when the scheduler fails (stop_parent_tritonserver inside Triton; the scheduler's module docstring says
        why the server stops rather than going on)."""
        self.pb = pb_utils
        self.stop_server = stop_server
        rows = engine_pipeline(engine_dir).limits.max_batch_size
        # The engine is loaded on the scheduler's thread, which runs all its forwards (see Scheduler).
        self.scheduler = Scheduler(lambda: Engine(engine_dir, device=device, batch_size=rows), on_step=self._on_step,
                                   on_failure=self._on_failure)
        self.engine = self.scheduler.engine
        fault = inject_from_environment(self.engine.proposer)
        if fault is not None:
            pb_utils.Logger.log_warn(f"specdeploy: a fault is injected ({fault}): a test server, serving no one")
        # Text requests are tokenised on Triton's thread; the engine's tokenizer detokenises on the scheduler's.
        self.encoder = load_tokenizer_files(Path(engine_dir) / "target")
        self.metrics = Metrics(pb_utils, {"model": model_name, "method": self.engine.method})
        self._on_step(self.scheduler)  # the gauges start at their idle values, not at 0
        self.metrics.report_cpu_threads(self.engine.cpu_threads.threads, self.engine.cpu_threads.source)
        self.watcher = DrainWatcher(self.scheduler)
        pb_utils.Logger.log_info(f"specdeploy: {engine_dir} ({self.engine.method}, gamma "
                                 f"{self.engine.num_draft_tokens}), {self.scheduler.max_batch_size} rows, on "
                                 f"{device}, {self.engine.cpu_threads.sentence()}")

    def _on_step(self, scheduler: Scheduler) -> None:
        if hasattr(self, "metrics"):  # steps only run once requests arrive, after __init__ has finished
            self.metrics.update(scheduler.counters, len(scheduler.active), scheduler.free_kv_slots,
                                len(scheduler.waiting))

    def _on_failure(self, failure: str) -> None:
        """The scheduler failed and ended every request: say why in the log and in the launcher's failure file
        (`specdeploy serve` exits non-zero with it), then stop the server so that it is restarted."""
        self.pb.Logger.log_error(f"specdeploy: {failure}")
        path = os.environ.get(FAILURE_FILE_VARIABLE)
        if path:
            Path(path).write_text(failure + "\n")
        if self.stop_server is not None:
            self.stop_server()

    def stop(self) -> None:
        self.watcher.stop()
        self.scheduler.stop()

    def submit(self, request) -> None:
        """Queue one request (see serving.read_request); a bad one gets its error response here."""
        submit_request(self.pb, request, self.encoder, self.engine.pipeline, self.engine.tokenizer, self.scheduler,
                       self.metrics)
