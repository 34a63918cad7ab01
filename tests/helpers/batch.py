"""For the batch decoder's tests: a counter of host reads, and a batch of mixed requests."""

from __future__ import annotations

import torch

from helpers.prompts import PROMPTS
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

GREEDY = SamplingParams()


class HostReads:
    """Counts every read of a tensor's values by Python (the host syncs of a GPU run) while active."""

    READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        self.count = 0
        self.saved = {}

    def __enter__(self) -> HostReads:
        for name in self.READS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def mixed_requests() -> list[GenerationRequest]:
    """Greedy, sampled, penalised and sampled-penalised requests with proposal lengths 3, 2, 4 and 1."""
    return [GenerationRequest(PROMPTS[0], 30, GREEDY, 3, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=0.8, top_k=20, seed=1), 2, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[2], 30, SamplingParams(repetition_penalty=1.3), 4, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=2), 1,
                              end_id=NO_END_ID)]
