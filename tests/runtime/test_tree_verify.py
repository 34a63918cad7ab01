"""Tree verification in the batch decoder (what Medusa drafts into): one forward under a tree attention mask gives
every node the logits of the sequential forward along its path, greedy tree speculation reproduces plain greedy
decode token for token (alone and batched), and after each step the target's cache holds exactly the committed
prefix (the accepted path moved into place, everything else discarded)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engines import fresh_prefill
from helpers.prompts import PROMPTS

from specdeploy.decoding.sequence import Sequence
from specdeploy.models.llama import tree_forward_all
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.spec.token_tree import TokenTree
from specdeploy.speculative.proposer import Proposal, Proposer
from specdeploy.speculative.row_trees import RowTrees

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]
GREEDY = SamplingParams()


class ScriptedTree(Proposer):
    """Proposes the tree with the reference continuation placed along one random branch per step, cut at a random
    depth, and wrong tokens everywhere else: steps accept 0..depth nodes, through first and later siblings."""

    def __init__(self, tree: TokenTree, references: dict[int, list[int]], vocab: int, seed: int = 0) -> None:
        self.tree, self.references, self.vocab = tree, references, vocab
        self.chooser = random.Random(seed)

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        rows = []
        for sequence, gamma in zip(sequences, gammas):
            reference = self.references[sequence.prompt_length]
            done = len(sequence.committed) - sequence.prompt_length  # reference[done] follows the pending token
            branch = [self.chooser.randrange(2) for _ in range(self.tree.depth)]
            correct_depth = self.chooser.randrange(self.tree.depth + 1)
            tokens = []
            for path in self.tree.paths[:self.tree.nodes_up_to(gamma)]:
                depth = len(path)
                true = reference[done + depth - 1] if done + depth - 1 < len(reference) else 0
                on_branch = list(path) == branch[:depth] and depth <= correct_depth
                tokens.append(true if on_branch else (true + 1 + path[-1]) % self.vocab)
            rows.append(tokens)
        proposal = Proposal.from_lists(rows, "cpu")
        proposal.tree = RowTrees.of(self.tree, proposal.counts)
        return proposal


def request(prompt: list[int], max_tokens: int, gamma: int) -> GenerationRequest:
    """Greedy, with no end token, so every generation runs to max_tokens."""
    return GenerationRequest(prompt, max_tokens, GREEDY, gamma, end_id=NO_END_ID)


def scripted_engine(tiny_engines, references: dict[int, list[int]], batch_size: int) -> Engine:
    engine = Engine(tiny_engines["ngram"].dir, batch_size=batch_size)
    proposer = ScriptedTree(TokenTree.from_choices(CHOICES), references, engine.vocab_size)
    engine.proposer = engine.decoder.proposer = proposer
    return engine


def test_tree_forward_gives_each_node_its_paths_logits(tiny_engines):
    """fp32: the logits at every node equal a sequential forward over the prefix and the node's path."""
    model = tiny_engines["ngram"].target
    tree = TokenTree.from_choices(CHOICES)
    generator = torch.Generator().manual_seed(0)
    prefixes = [PROMPTS[0], PROMPTS[2]]  # two rows of different lengths
    nodes = torch.randint(3, 128, (2, tree.size), generator=generator)
    cache = model.new_cache(2, 64)
    for row, prefix in enumerate(prefixes):
        view = cache.rows(row, row + 1)
        model(torch.tensor([prefix[:-1]]), torch.arange(len(prefix) - 1)[None], view)
    tokens = torch.cat([torch.tensor([[p[-1]] for p in prefixes]), nodes], 1)
    starts = [len(p) - 1 for p in prefixes]
    hidden = tree_forward_all(model, cache, tokens, starts, torch.tensor(tree.depths()),
                              torch.tensor(tree.ancestry)).hidden
    logits = model.logits(hidden)  # [2, N + 1, V]
    for row, prefix in enumerate(prefixes):
        for index in range(tree.size + 1):
            path = [i for i in range(1, index + 1) if tree.ancestry[index][i]]
            sequence = prefix + [int(nodes[row, i - 1]) for i in path]
            sequential = model.logits(model(torch.tensor([sequence]), torch.arange(len(sequence))[None],
                                            model.new_cache(1, 64)).hidden)[0, -1]
            torch.testing.assert_close(logits[row, index], sequential, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_greedy_tree_speculation_equals_plain_alone(tiny_engines, gamma):
    plain = tiny_engines["ngram"]
    references = {len(p): plain.start(request(p, 40, 0)).run() for p in PROMPTS}
    engine = scripted_engine(tiny_engines, references, 1)
    accepted = 0
    for prompt in PROMPTS:
        generation = engine.start(request(prompt, 40, gamma))
        assert generation.run() == references[len(prompt)]
        accepted += generation.stats.accepted
    assert accepted > 0


def test_greedy_tree_speculation_equals_plain_batched_and_the_cache_is_the_committed_prefix(tiny_engines):
    """Three rows (of different prompt lengths, one capped at depth 1) stepped together: each commits plain greedy's
    tokens, and after every step each row's cache equals a fresh prefill of its committed prefix."""
    plain = tiny_engines["ngram"]
    references = {len(p): plain.start(request(p, 30, 0)).run() for p in PROMPTS}
    engine = scripted_engine(tiny_engines, references, 3)
    decoder = engine.decoder
    sequences = []
    for row, prompt in enumerate(PROMPTS):
        sequence = engine.new_sequence(request(prompt, 30, gamma=1 if row == 1 else 4))
        decoder.prefill(sequence, row)
        sequences.append(sequence)
    steps = 0
    while all(s.finish_reason is None for s in sequences):  # rows end at different steps: check while all run
        decoder.step(sequences)
        steps += 1
        for row, sequence in enumerate(sequences):
            generated = sequence.committed[sequence.prompt_length:]
            assert generated == references[sequence.prompt_length][:len(generated)]
            length = engine.cache.lengths[row]
            assert length == len(sequence.committed) - 1
            fresh = fresh_prefill(engine.target, sequence.committed[:length], 256)
            for ours, expected in zip(engine.cache.stacked(), fresh.stacked()):  # keys, then values
                torch.testing.assert_close(ours[:, row, :, :length], expected[:, 0, :, :length], atol=1e-4, rtol=1e-4)
    assert sum(s.stats.accepted for s in sequences) > 0 and steps >= 5


def test_mixed_rows_verify_a_tree_with_one_host_read_and_keep_their_caches(tiny_engines):
    """Greedy, sampled and penalised rows with different depth caps: one host read per step, and each row's cache
    stays the committed prefix (sampled rows accept through other branches than greedy ones)."""
    from helpers.batch import HostReads, mixed_requests

    plain = tiny_engines["ngram"]
    references = {len(p): plain.start(request(p, 30, 0)).run() for p in PROMPTS}
    engine = scripted_engine(tiny_engines, references, 4)
    sequences = [engine.new_sequence(r) for r in mixed_requests()]
    for row, sequence in enumerate(sequences):
        engine.decoder.prefill(sequence, row)
    for _ in range(4):
        with HostReads() as reads:
            engine.decoder.step(sequences)
        assert reads.count == 1
        for row, sequence in enumerate(sequences):
            length = engine.cache.lengths[row]
            assert length == len(sequence.committed) - 1
            fresh = fresh_prefill(engine.target, sequence.committed[:length], 256)
            keys, fresh_keys = engine.cache.stacked()[0], fresh.stacked()[0]
            torch.testing.assert_close(keys[:, row, :, :length], fresh_keys[:, 0, :, :length], atol=1e-4, rtol=1e-4)
    assert all(s.stats.drafted > 0 for s in sequences)
