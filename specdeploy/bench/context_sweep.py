"""`bench PIPELINE --context 256,1024,2048`: speculation's speedup against context length, measured and predicted.

Each prompt is padded to about each length with held-out corpus text (text_corpus.py's held-out half), placed
before the question in the user message. At each length the in-process bench (bench/run.py) decodes every padded
prompt plain and with speculation, so acceptance, costs and speeds are measured per length.

The prediction models what a decode step reads. A plain target step reads the weights (W bytes) and the keys and
values of the m positions before it (m K bytes). A verify forward over gamma + 1 positions reads the weights and
the KV cache once as well, so the KV read adds to plain and verify steps alike and the verify cost v in plain
steps falls toward 1 as the context grows: the favourable case the seed names. A draft model's forward reads its
own weights and its KV (W_d + m K_d); a draft derived from the target reads as much KV as the target with fewer
weight bytes, so its cost c in plain steps grows with the context. A draft-free proposer (n-gram, Medusa's heads)
takes about the same time at every length, so its cost in plain steps falls. The costs measured at the shortest
length are carried to the others by those bytes; tokens per step are measured at each length (acceptance itself
changes with the context). m is the padded prompt's length plus half the answer's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.progress import track

from specdeploy.bench.measure import kv_bytes_per_position
from specdeploy.bench.results import BenchReport
from specdeploy.bench.run import run_bench
from specdeploy.build import text_corpus as corpus
from specdeploy.errors import SpecdeployError
from specdeploy.models import machine
from specdeploy.runtime.engine import Engine
from specdeploy.speculative.speedup import speedup


@dataclass
class ContextPoint:
    """One context length: what was measured there, and the bytes model's prediction."""

    context: int  # asked for
    prompt_tokens: float  # the padded prompts' mean length
    kv_positions: float  # m: the mean KV length a decode step reads (prompt plus half the answer)
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    tokens_per_step: float
    proposal_cost_per_step: float  # plain steps
    verify_cost_ratio: float  # plain steps
    kv_share_of_plain_step: float  # m K / (W + m K): the KV cache's share of a plain step's bytes
    plain_slowdown: float  # the shortest length's plain tokens/s over this one's
    predicted_plain_slowdown: float  # (W + m K) / (W + m0 K)
    predicted_speedup: float  # tokens per step over the costs the bytes model carries from the shortest length
    speedup_from_measured_costs: float  # tokens per step over the costs measured here


@dataclass
class ContextSweep:
    pipeline: str
    method: str
    num_draft_tokens: int
    dtype: str
    max_tokens: int
    prompts: int
    machine: dict
    target_weight_bytes: int  # W: read by a plain step
    target_kv_bytes_per_position: int  # K
    draft_weight_bytes: int | None  # W_d; None for a draft-free proposer
    draft_kv_bytes_per_position: int | None  # K_d
    points: list[ContextPoint]

    def to_json(self) -> dict:
        return asdict(self)


def check_contexts(engine: Engine, contexts: tuple[int, ...], max_tokens: int) -> None:
    """Refuse lengths the model cannot hold; the engine is loaded with room for them (Engine max_sequence_length)."""
    if not contexts or any(context < 1 for context in contexts):
        raise SpecdeployError(f"--context: give context lengths of at least 1 token, got {list(contexts)}")
    longest = max(contexts) + max_tokens + engine.pipeline.limits.max_draft_tokens + 1
    positions = engine.target.config.max_position_embeddings
    if longest > positions:
        raise SpecdeployError(f"--context {max(contexts)} with {max_tokens} answer tokens needs {longest} positions; "
                              f"the target's max_position_embeddings is {positions}")
    room = sequence_room(contexts, max_tokens)
    if room > engine.max_length:
        raise SpecdeployError(f"--context {max(contexts)}: the engine was loaded for sequences of "
                              f"{engine.max_length} tokens (load it with max_sequence_length={room})")


def sequence_room(contexts: tuple[int, ...], max_tokens: int) -> int:
    """The sequence length an engine needs for the longest context and its answer (Engine max_sequence_length)."""
    return max(contexts) + max_tokens


def filler_ids(tokenizer) -> list[int]:
    """Token ids of the held-out corpus, twice over so that any start has a long run after it."""
    _, texts = corpus.calibration_split()
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return ids + ids


def pad_prompt(engine: Engine, prompt: str, length: int, filler: list[int], start: int) -> str:
    """`prompt` after held-out text, about `length` tokens in all with the chat template; the prompt alone when it
    is that long already. Decoded text may re-tokenize a few tokens longer: the excess is cut once."""
    room = length - len(engine.encode_prompt(f"\n\n{prompt}"))
    if room <= 0:
        return prompt
    start %= len(filler) // 2
    padded = f"{engine.tokenizer.decode(filler[start:start + room])}\n\n{prompt}"
    excess = len(engine.encode_prompt(padded)) - length
    if excess > 0:
        padded = f"{engine.tokenizer.decode(filler[start:start + room - excess])}\n\n{prompt}"
    return padded


def run_context_sweep(engine: Engine, prompts: list[dict], contexts: tuple[int, ...], max_tokens: int | None,
                      temperature: float | None, seed: int, quiet: bool = False) -> ContextSweep:
    """Every prompt padded to each length in `contexts`, decoded plain and with speculation at each."""
    answer = engine.pipeline.sampling.max_tokens if max_tokens is None else max_tokens
    check_contexts(engine, contexts, answer)
    filler = filler_ids(engine.tokenizer)
    spacing = len(filler) // 2 // len(prompts)  # each prompt reads other text
    lengths, reports, ascending = [], [], sorted(contexts)
    for context in track(ascending, description="context", disable=quiet):
        padded = [{"prompt": pad_prompt(engine, item["prompt"], context, filler, index * spacing),
                   "kind": item["kind"]} for index, item in enumerate(prompts)]
        lengths.append(sum(len(engine.encode_prompt(p["prompt"])) for p in padded) / len(padded))
        reports.append(run_bench(engine, padded, answer, temperature, seed, with_transformers=False, quiet=True))
    return sweep(engine, ascending, lengths, reports, answer)


@dataclass(frozen=True)
class StepBytes:
    """What a decode step reads: W and K of the target, W_d and K_d of the draft model (None: draft-free)."""

    weights: int
    kv_per_position: int
    draft_weights: int | None = None
    draft_kv_per_position: int | None = None

    @classmethod
    def of(cls, engine: Engine) -> StepBytes:
        drafts = engine.proposer.stepped_models()
        return cls(engine.target.weight_bytes_per_token(), kv_bytes_per_position(engine.target, engine.cache),
                   sum(model.weight_bytes_per_token() for model, _ in drafts) if drafts else None,
                   sum(kv_bytes_per_position(model, cache) for model, cache in drafts) if drafts else None)

    def plain(self, m: float) -> float:
        return self.weights + m * self.kv_per_position

    def draft(self, m: float) -> float | None:
        return None if self.draft_weights is None else self.draft_weights + m * self.draft_kv_per_position


@dataclass(frozen=True)
class ModelledCosts:
    plain_slowdown: float  # a plain step's time at m over its time at m0
    proposal_cost_per_step: float  # plain steps at m
    verify_cost: float  # plain steps at m


def carried_costs(step: StepBytes, proposal_cost: float, verify_cost: float, m0: float, m: float) -> ModelledCosts:
    """The costs measured at m0 (in plain steps there) carried to m by the bytes each step reads: the verify
    forward and the plain step both read the KV cache once; a draft model's forward reads its own; a draft-free
    proposer's time does not change."""
    slowdown = step.plain(m) / step.plain(m0)
    draft_growth = 1.0 if step.draft_weights is None else step.draft(m) / step.draft(m0)
    verify = (verify_cost * step.plain(m0) + (m - m0) * step.kv_per_position) / step.plain(m)
    return ModelledCosts(slowdown, proposal_cost * draft_growth / slowdown, verify)


def sweep(engine: Engine, contexts: list[int], prompt_lengths: list[float], reports: list[BenchReport],
          max_tokens: int) -> ContextSweep:
    """The measured points with the bytes model's prediction (see the module docstring)."""
    step = StepBytes.of(engine)
    positions = [length + max_tokens / 2 for length in prompt_lengths]
    base, m0 = reports[0].summary, positions[0]
    points = []
    for context, length, m, report in zip(contexts, prompt_lengths, positions, reports):
        summary = report.summary
        modelled = carried_costs(step, base.proposal_cost_per_step, base.verify_cost_ratio, m0, m)
        tokens = summary.mean_accepted_length
        points.append(ContextPoint(
            context=context, prompt_tokens=length, kv_positions=m,
            plain_tokens_per_s=summary.baseline_tokens_per_s, speculative_tokens_per_s=summary.speculative_tokens_per_s,
            speedup=summary.speedup, acceptance_rate=summary.acceptance_rate, tokens_per_step=tokens,
            proposal_cost_per_step=summary.proposal_cost_per_step, verify_cost_ratio=summary.verify_cost_ratio,
            kv_share_of_plain_step=m * step.kv_per_position / step.plain(m),
            plain_slowdown=base.baseline_tokens_per_s / summary.baseline_tokens_per_s,
            predicted_plain_slowdown=modelled.plain_slowdown,
            predicted_speedup=speedup(tokens, modelled.proposal_cost_per_step + modelled.verify_cost),
            speedup_from_measured_costs=speedup(tokens, summary.proposal_cost_per_step + summary.verify_cost_ratio)))
    return ContextSweep(pipeline=engine.pipeline.name, method=engine.method, num_draft_tokens=engine.num_draft_tokens,
                        dtype=engine.dtype, max_tokens=max_tokens, prompts=reports[0].setup.prompts,
                        machine=machine.describe(), target_weight_bytes=step.weights,
                        target_kv_bytes_per_position=step.kv_per_position, draft_weight_bytes=step.draft_weights,
                        draft_kv_bytes_per_position=step.draft_kv_per_position, points=points)
