"""One request's decoding state, as the batch decoder and the proposers see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdeploy.decoding.finish import Finish
from specdeploy.decoding.stats import RequestStats
from specdeploy.decoding.stop_strings import StopStrings
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

if TYPE_CHECKING:  # the schedule object is made by the runtime; a sequence only carries it
    from specdeploy.decoding.draft_length import ProposalLength


@dataclass
class Sequence:
    """`committed` is prompt + generated tokens; the last one is pending (not yet in the target's cache).

    end_ids: tokens that end the request (the model's end-of-sequence tokens, or the request's end_id);
    stop_sequences: token sequences that end it when the generated tokens end with one of them;
    stop_strings: the request's stop strings, watched in its generated text (decoding/stop_strings.py).
    """

    committed: list[int]
    prompt_length: int
    params: SamplingParams
    max_tokens: int
    proposal: ProposalLength
    stats: RequestStats
    end_ids: frozenset[int]
    stop_sequences: list[list[int]] = field(default_factory=list)
    stop_strings: StopStrings | None = None
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # [V] bool, for the repetition penalty
    finish_reason: Finish | None = None
    finish_detail: str = ""  # what failed, or why the server ended it (ERROR, SHUTDOWN)

    @classmethod
    def for_request(cls, request: GenerationRequest, proposal: ProposalLength, end_ids: frozenset[int],
                    generator: torch.Generator | None = None, seen: torch.Tensor | None = None,
                    tokenizer=None) -> Sequence:
        """A checked request's sequence, before its prefill. end_ids: the model's end tokens, which the request's
        end_id replaces (-1: none). tokenizer: detokenises the generated text for the request's stop strings."""
        if request.end_id is not None:
            end_ids = frozenset() if request.end_id == NO_END_ID else frozenset([request.end_id])
        prompt = list(request.prompt_ids)
        return cls(committed=prompt, prompt_length=len(prompt), params=request.sampling,
                   max_tokens=request.max_tokens, proposal=proposal, stats=RequestStats(prompt_tokens=len(prompt)),
                   end_ids=end_ids, stop_sequences=[list(s) for s in request.stop_sequences if s],
                   stop_strings=StopStrings(tokenizer, request.stop_strings) if request.stop_strings else None,
                   generator=generator, seen=seen)

    @property
    def cache_length(self) -> int:
        return len(self.committed) - 1

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_length

    @property
    def remaining(self) -> int:
        """Tokens the request may still emit."""
        return self.max_tokens - self.generated

    def append(self, tokens: list[int]) -> list[int]:
        """Commit a step's tokens up to the first that ends the request (an end token, the end of a stop sequence,
        the token whose text completes a stop string, or max_tokens), setting `finish_reason`. Returns what was
        committed."""
        emitted = []
        for token in tokens[:self.remaining]:
            emitted.append(token)
            self.committed.append(token)
            completes_stop = self.stop_strings is not None and self.stop_strings.completes(token)
            if token in self.end_ids or self._ends_with_stop_sequence() or completes_stop:
                self.end(Finish.STOP)
                break
        if self.finish_reason is None and self.remaining <= 0:
            self.end(Finish.LENGTH)
        return emitted

    def end(self, reason: Finish, detail: str = "") -> None:
        """Mark the request finished, in its statistics too."""
        self.finish_reason, self.finish_detail = reason, detail
        self.stats.finish_reason, self.stats.finish_detail = reason, detail

    def _ends_with_stop_sequence(self) -> bool:
        """Only generated tokens count: a stop sequence that begins in the prompt never matches."""
        generated = self.generated
        return any(len(stop) <= generated and self.committed[-len(stop):] == stop for stop in self.stop_sequences)
