"""A tiny EAGLE-3 head for the tiny target (helpers/tiny_models.py), trained in seconds by the same code as
`specdeploy train-eagle` on the target's greedy continuations of random prompts: confident and right often enough
that trees are accepted past their root, which random weights never are."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from specdeploy.speculative.draft_vocabulary import most_frequent_tokens
from specdeploy.speculative.eagle_head import Eagle3Head, EagleConfig
from specdeploy.training.eagle import collect, train

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 128, 96
FEATURE_LAYERS = (0, 1, 1)  # the tiny target has two layers


def tiny_config(feature_layers=FEATURE_LAYERS, draft_vocab: int = DRAFT_VOCAB) -> EagleConfig:
    return EagleConfig(hidden_size=HIDDEN, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=VOCAB, draft_vocab_size=draft_vocab, feature_layers=feature_layers,
                       max_position_embeddings=512)


def trained_tiny_head(engine, directory: Path, steps: int = 3, epochs: int = 15) -> Eagle3Head:
    """Train a head on `engine`'s target (an fp32 tiny engine) and save it in `directory`."""
    from specdeploy.spec.request import NO_END_ID, GenerationRequest
    from specdeploy.spec.sampling_params import SamplingParams

    chooser = random.Random(0)
    sequences = []
    for _ in range(56):
        prompt = [chooser.randrange(3, VOCAB) for _ in range(chooser.randrange(4, 12))]
        answer = engine.start(GenerationRequest(prompt, 60, SamplingParams(), 0, end_id=NO_END_ID)).run()
        sequences.append((prompt + answer, len(prompt) - 1))
    samples = collect(engine.target, sequences, FEATURE_LAYERS)
    torch.manual_seed(0)
    head = Eagle3Head(tiny_config())
    ids = torch.tensor(most_frequent_tokens((s.tokens.tolist() for s in samples), DRAFT_VOCAB, VOCAB))
    head.set_draft_vocabulary(ids)
    rows = engine.target.lm_head.weight.detach().float()[ids]
    work = directory.parent / f"{directory.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    head, _ = train(head, samples, engine.target.embed.detach().float(), rows, steps, epochs, work, lr=3e-3)
    head.save(directory)
    return head
