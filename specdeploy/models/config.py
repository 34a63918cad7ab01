"""ModelConfig: the architecture of one engine, validated at construction and saved next to its weights."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdeploy.errors import SpecdeployError


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's dimensions; `architecture` names its family in models/registry.py. `quantization` is None
    (dense) or a description of a weight-only quantized copy (see build/torch_engine.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    quantization: dict | None = field(default=None)
    num_experts: int = 0  # mixtral: experts per MoE layer (intermediate_size is one expert's); 0 for dense
    experts_per_token: int = 0  # mixtral: k, the experts each token is routed to

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise SpecdeployError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise SpecdeployError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.architecture == "mixtral" and not 1 <= self.experts_per_token <= self.num_experts:
            raise SpecdeployError(f"model config: a mixtral needs 1 ≤ experts_per_token ≤ num_experts, got "
                                  f"{self.experts_per_token} of {self.num_experts}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @classmethod
    def from_hf(cls, hf_config, torch_engine: bool = True) -> ModelConfig:
        """From a transformers LlamaConfig or MixtralConfig (or anything with the same attribute names).
        torch_engine: refuse what the torch engine does not compute (rope scaling, a sliding window); False for a
        model only described, as TensorRT-LLM's builds do (rope_scaling then says what the config has)."""
        rope = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaling = rope_scaling(hf_config)
        if torch_engine and scaling is not None:
            raise SpecdeployError(f"rope scaling {scaling['rope_type']!r} is not supported (allowed: default)")
        eos = hf_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        window = getattr(hf_config, "sliding_window", None)
        if torch_engine and window is not None and window < hf_config.max_position_embeddings:
            raise SpecdeployError(f"sliding-window attention (sliding_window {window}) is not supported")
        return cls(
            architecture=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            eos_token_ids=tuple(eos),
            num_experts=getattr(hf_config, "num_local_experts", 0) or 0,
            experts_per_token=getattr(hf_config, "num_experts_per_tok", 0) or 0,
        )

    def to_hf(self):
        """The equivalent transformers LlamaConfig or MixtralConfig (for parity tests, the transformers baseline
        and exports)."""
        from transformers import LlamaConfig, MixtralConfig

        family = LlamaConfig
        extra: dict = {}
        if self.architecture == "mixtral":
            family = MixtralConfig
            extra = {"num_local_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
                     "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}
        return family(
            **extra, vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=list(self.eos_token_ids) or None,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        return cls(**data)


def rope_scaling(hf_config) -> dict | None:
    """A transformers config's rope scaling parameters (rope_type and its factors), None for plain RoPE."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    return None if rope.get("rope_type", "default") == "default" else rope
