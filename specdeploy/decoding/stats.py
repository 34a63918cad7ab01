"""Per-request speculation statistics: what was drafted, what survived, and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted: int = 0  # drafted tokens sent to verification
    accepted: int = 0  # drafted tokens that survived
    steps: int = 0  # target forwards after prefill (verification steps, or plain decode steps)
    speculative_steps: int = 0  # steps that verified at least one drafted token
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps that drafted position i+1
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that accepted position i+1
    draft_forwards: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forwards after prefill + acceptance
    total_seconds: float = 0.0
    finish_reason: str = ""  # a Finish value once the request has ended
    finish_detail: str = ""

    def record_step(self, drafted: int, accepted: int, positions: int | None = None) -> None:
        """drafted tokens (a tree's nodes), accepted ones, and how many successive positions were proposed
        (a chain's drafted tokens, the default; a tree's depth: position i+1 is then head i's)."""
        self.steps += 1
        if drafted == 0:
            return
        positions = drafted if positions is None else positions
        self.speculative_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_per_position, positions), (self.accepted_per_position, accepted)):
            if len(counts) < positions:
                counts.extend([0] * (positions - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tokens(self) -> int:
        return decode_tokens(self.generated_tokens)

    @property
    def decode_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.decode_tokens, self.steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def decode_tokens_per_s(self) -> float:
        return decode_rate([self])

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                    per_position_acceptance=self.per_position_acceptance,
                    decode_tokens_per_s=self.decode_tokens_per_s)
        return data


def decode_tokens(generated_tokens: int) -> int:
    """Tokens committed after prefill (the first token comes from prefill, which speculation never touches)."""
    return max(generated_tokens - 1, 0)


def mean_accepted_length(decoded: int, steps: int) -> float:
    """Tokens emitted per target step after prefill, bonus/recovered token included (≥ 1): `decoded` tokens
    committed after prefill over `steps` target steps, of one request or summed over several."""
    return decoded / steps if steps else 0.0


def decode_rate(stats: list[RequestStats]) -> float:
    """Decode-phase tokens/s over several requests: all their decode tokens over all their decode time."""
    seconds = sum(s.decode_seconds for s in stats)
    return sum(s.decode_tokens for s in stats) / seconds if seconds else 0.0
