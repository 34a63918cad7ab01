"""The backend section of a pipeline: which engine the build produces (torch or TensorRT-LLM) with its settings,
and the combinations each cannot serve (check_backend, which PipelineSpec.check calls with the whole pipeline)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from specdeploy.errors import PipelineError
from specdeploy.spec.strict_yaml import Problem, Section

if TYPE_CHECKING:
    from specdeploy.spec.pipeline import PipelineSpec

BackendKind = Literal["torch", "trtllm"]
Device = Literal["cpu", "cuda"]  # where the torch backend runs: the CPU, or an NVIDIA GPU
StepsMode = Literal["measured", "compiled", "eager"]


@dataclass(frozen=True)
class TrtllmSpec(Section):
    """TensorRT-LLM settings (backend.kind: trtllm). line: `engine` builds TensorRT engines with TensorRT-LLM 1.2.x
    (trtllm-build), `llm_api` serves through the LLM API's PyTorch backend of newer releases. server: Triton (its
    tensorrtllm backend, or its llmapi model on the llm_api line) or trtllm-serve. moe_tp_size × moe_ep_size must
    equal tp_size (unset: TensorRT-LLM's completion, tp × 1). Batch, input and sequence limits come from `limits`;
    the draft's weight-only int4 or int8 from speculation.draft.derive. medusa_converter: TensorRT-LLM's
    examples/medusa/convert_checkpoint.py, which is not in its wheel; the default is where the pinned Triton image
    keeps it (tensorrtllm_backend's Dockerfile: WORKDIR /app, the repository's examples copied to examples)."""

    line: Literal["engine", "llm_api"] = "engine"
    server: Literal["triton", "trtllm_serve"] = "triton"
    dtype: Literal["float16", "bfloat16"] = "bfloat16"
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    max_num_tokens: int = 8192
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True
    medusa_converter: str = "/app/examples/medusa/convert_checkpoint.py"

    def check(self) -> None:
        for key in ("tp_size", "pp_size", "max_num_tokens"):
            if getattr(self, key) < 1:
                raise Problem(key, f"must be ≥ 1, got {getattr(self, key)}")
        for key in ("moe_tp_size", "moe_ep_size"):
            value = getattr(self, key)
            if value is not None and (value < 1 or self.tp_size % value):
                raise Problem(key, f"must divide tp_size ({self.tp_size}), got {value}")
        if self.moe_tp_size is not None and self.moe_ep_size is not None \
                and self.moe_tp_size * self.moe_ep_size != self.tp_size:
            raise Problem("moe_ep_size", f"moe_tp_size × moe_ep_size must equal tp_size ({self.tp_size}), got "
                                         f"{self.moe_tp_size} × {self.moe_ep_size}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction < 1:  # the executor's KvCacheConfig refuses 0 and 1
            raise Problem("kv_cache_free_gpu_mem_fraction", f"must be in (0, 1), got "
                                                            f"{self.kv_cache_free_gpu_mem_fraction}")


@dataclass(frozen=True)
class TorchSpec(Section):
    """Torch backend settings (backend.kind: torch). device: cuda runs build measurements, generate, bench and serve
    on an NVIDIA GPU (Triton gives the engine's model KIND_GPU instances); the engine files are the same on both, so
    changing it rebuilds nothing."""

    device: Device = "cpu"
    # each stepped model's forward as an ahead-of-time compiled program (tune/step_programs.py): measured (built
    # and kept where faster than eager on this machine), compiled (kept whatever the timing), eager (none); CPU only
    steps: StepsMode = "measured"


@dataclass(frozen=True)
class BackendSpec(Section):
    """Which engine the build produces and the Triton repository serves; each kind brings its own settings."""

    kind: BackendKind = "torch"
    trtllm: TrtllmSpec | None = None  # kind trtllm only; None there: every default
    torch: TorchSpec | None = None  # kind torch only; None there: every default

    def check(self) -> None:
        if self.kind != "trtllm" and self.trtllm is not None:
            raise Problem("trtllm", f"only with kind: trtllm (kind is {self.kind!r})")
        if self.kind != "torch" and self.torch is not None:
            raise Problem("torch", f"only with kind: torch (kind is {self.kind!r}; TensorRT-LLM always runs on "
                                   f"GPUs)")

    @property
    def device(self) -> Device:
        """Where the torch backend's engine runs."""
        return self.torch.device if self.torch else "cpu"

    def with_device(self, device: Device) -> BackendSpec:
        """The same backend run on `device` (the CLI's --device); only the torch backend has a choice."""
        if self.kind != "torch":
            raise PipelineError(f"--device is for the torch backend (this pipeline's backend.kind is {self.kind!r})")
        return dataclasses.replace(self, torch=dataclasses.replace(self.torch or TorchSpec(), device=device))

    @property
    def steps(self) -> StepsMode:
        """What the build does about compiled step programs (backend.torch.steps)."""
        return (self.torch or TorchSpec()).steps

    @property
    def settings(self) -> TrtllmSpec:
        """The TensorRT-LLM settings (defaults when the section is left out)."""
        return self.trtllm or TrtllmSpec()



def check_backend(pipeline: PipelineSpec) -> None:
    """What the backend cannot run of this pipeline, as a Problem naming the key (paths from the pipeline's root)."""
    backend = pipeline.backend
    if backend.steps == "compiled":
        check_compiled_steps(pipeline)
    if backend.kind == "trtllm":
        check_trtllm(pipeline)


def check_compiled_steps(pipeline: PipelineSpec) -> None:
    """backend.torch.steps: compiled asks for what `measured` leaves eager, quietly, where a program cannot run."""
    key = "backend.torch.steps"
    if pipeline.serving.determinism == "batch_invariant":
        raise Problem(key, "a step program attends to every row at once, and serving.determinism "
                           "batch_invariant row by row (set batch_dependent, or steps: eager)")
    if pipeline.backend.device != "cpu":
        raise Problem(key, f"step programs are built and measured for the CPU only, and the engine runs on "
                           f"{pipeline.backend.device} (use steps: measured or eager)")


def check_trtllm(pipeline: PipelineSpec) -> None:
    """The combinations TensorRT-LLM cannot serve (facts in docs/tensorrt-llm.md), from the method's recipe
    (spec/speculation.py). The checks that need the model's head and expert counts run at build
    (build/trtllm/plan.check_model_fits)."""
    settings, speculation, method = pipeline.backend.settings, pipeline.speculation, pipeline.speculation.method
    recipe = speculation.traits.trtllm
    if not recipe.lines:
        raise Problem("speculation.method", recipe.refusal)
    if recipe.moe_refusal and pipeline.target.moe is not None:
        raise Problem("speculation.method", recipe.moe_refusal)
    if settings.line not in recipe.lines:
        raise Problem("backend.trtllm.line", recipe.refusal)
    if settings.server not in recipe.servers:
        raise Problem("backend.trtllm.server", recipe.server_refusal)
    check_trtllm_settings = getattr(speculation.settings, "check_trtllm", None)
    if check_trtllm_settings is not None:
        try:
            check_trtllm_settings()
        except Problem as problem:
            raise Problem(f"speculation.{speculation.traits.section}.{problem.key}", problem.message) from None
    if recipe.greedy_only:
        check_greedy_defaults(pipeline)
    orchestrated = settings.line == "engine" and recipe.orchestrated
    if orchestrated and settings.server == "trtllm_serve":
        raise Problem("backend.trtllm.server", f"{method} on the engine line runs through Triton (our "
                                               f"orchestration model feeds draft tokens to the engine); the "
                                               f"LLM API serves {method} only on line: llm_api")
    if orchestrated and not settings.enable_kv_cache_reuse:
        raise Problem("backend.trtllm.enable_kv_cache_reuse", f"{method} verifies drafts on a "
                                                              f"{recipe.engine_mode} target engine, which "
                                                              f"TensorRT-LLM refuses to load without KV cache "
                                                              f"block reuse: set it true")
    if settings.line == "llm_api" and pipeline.target.weight_only is not None:
        raise Problem("target.weight_only", "needs the engine line (TensorRT-LLM quantizes it at conversion); "
                                            "on line: llm_api give a quantized checkpoint instead")
    draft = speculation.draft
    if settings.line == "llm_api" and draft is not None and draft.derive != "none":
        raise Problem("speculation.draft.derive", f"{draft.derive} needs the engine line (TensorRT-LLM "
                                                  f"quantizes it at conversion); on line: llm_api give the "
                                                  f"draft a checkpoint (derive: none)")


def check_greedy_defaults(pipeline: PipelineSpec) -> None:
    """A method TensorRT-LLM decodes greedily only (lookahead: docs/tensorrt-llm.md): the pipeline's own sampling
    defaults must be greedy and unpenalised (each request is checked again when it arrives:
    serve/trtllm/orchestration.py)."""
    sampling, method = pipeline.sampling, pipeline.speculation.method
    if not sampling.params().greedy:
        raise Problem("sampling.temperature", f"TensorRT-LLM's {method} decoding is greedy only (it takes the "
                                              f"top token at every position and ignores temperature, top_k and "
                                              f"top_p), so requests at this default would be refused: set 0, "
                                              f"got {sampling.temperature}")
    if sampling.repetition_penalty != 1:
        raise Problem("sampling.repetition_penalty", f"TensorRT-LLM's {method} decoding applies no penalties, "
                                                     f"so requests at this default would be refused: set 1, got "
                                                     f"{sampling.repetition_penalty}")
