"""The orchestration's engine calls as Triton BLS requests to the `tensorrtllm` backend's models, with the tensor
names, types and shapes of the pinned release's template (build/trtllm/upstream.py). `pb_utils` is passed in.

Each call sends the whole sequence (`input_ids` [1, L]); the backend's KV block reuse finds the cached prefix.
Scalars go as [1, 1] (the model reshapes them per request). Outputs exclude the input (`exclude_input_in_output`
is set in the model's parameters): `output_ids` [1, beam, n], `generation_logits` [1, beam, n, V].
`draft_acceptance_threshold` is never sent: with it the engine accepts by a fixed threshold, which is not exact;
without it, it draws the acceptance test at random, as the exact rule does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from specdeploy.serve.trtllm.orchestration import Sampling
from specdeploy.spec.request import NO_END_ID

OUTPUTS = ["output_ids", "sequence_length"]


def scalar(pb, name: str, value, dtype) -> object:
    return pb.Tensor(name, np.array([[value]], dtype=dtype))


def sampling_tensors(pb, sampling: Sampling) -> list:
    """The request's sampling as the backend's inputs, with the call's seed and no end token (end_id -1: the
    orchestration ends requests itself). Greedy is top-k 1 at temperature 1 (the engine divides by the
    temperature; top_k 0 means no top-k)."""
    params = sampling.params
    return [scalar(pb, "end_id", NO_END_ID, np.int32), scalar(pb, "pad_id", 0, np.int32),
            scalar(pb, "temperature", 1.0 if params.greedy else params.temperature, np.float32),
            scalar(pb, "runtime_top_k", 1 if params.greedy else params.top_k, np.int32),
            scalar(pb, "runtime_top_p", params.top_p, np.float32),
            scalar(pb, "repetition_penalty", params.repetition_penalty, np.float32),
            scalar(pb, "seed", sampling.seed, np.uint64)]


class BlsCalls:
    """EngineCalls over BLS: `target_model` and `draft_model` are the tensorrtllm models' names."""

    def __init__(self, pb, target_model: str, draft_model: str | None) -> None:
        self.pb, self.target_model, self.draft_model = pb, target_model, draft_model

    def sampling_tensors(self, sampling: Sampling) -> list:
        return sampling_tensors(self.pb, sampling)

    def _request(self, model: str, tokens: list[int], count: int, sampling: Sampling, streaming: bool,
                 extra: list, outputs: list[str]) -> Iterator:
        pb = self.pb
        inputs = [pb.Tensor("input_ids", np.array([tokens], dtype=np.int32)),
                  scalar(pb, "input_lengths", len(tokens), np.int32),
                  scalar(pb, "request_output_len", count, np.int32),
                  scalar(pb, "streaming", streaming, np.bool_),
                  *self.sampling_tensors(sampling), *extra]
        request = pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs)
        for response in request.exec(decoupled=True):
            if response.has_error():
                raise RuntimeError(f"{model}: {response.error().message()}")
            if response.output_tensors():  # the backend's last response may carry only the final flag
                yield response

    def draft(self, tokens: list[int], count: int, sampling: Sampling, with_logits: bool
              ) -> tuple[list[int], np.ndarray | None]:
        pb = self.pb
        extra = [scalar(pb, "return_generation_logits", with_logits, np.bool_)]
        ids, logits = [], []
        outputs = OUTPUTS + ["generation_logits"] if with_logits else OUTPUTS
        for response in self._request(self.draft_model, tokens, count, sampling, False, extra, outputs):
            ids.extend(output_ids(pb, response))
            if with_logits:
                logits.append(pb.get_output_tensor_by_name(response, "generation_logits").as_numpy()[0, 0])
        return ids, (np.concatenate(logits)[:len(ids)] if with_logits and ids else None)

    def target(self, tokens: list[int], count: int, sampling: Sampling, draft_ids: list[int] | None = None,
               draft_logits: np.ndarray | None = None) -> Iterator[list[int]]:
        pb = self.pb
        extra = []
        if draft_ids:
            extra.append(pb.Tensor("draft_input_ids", np.array([draft_ids], dtype=np.int32)))
            if draft_logits is not None:
                extra.append(pb.Tensor("draft_logits", np.ascontiguousarray(draft_logits[None], dtype=np.float32)))
        for response in self._request(self.target_model, tokens, count, sampling, not draft_ids, extra, OUTPUTS):
            yield output_ids(pb, response)


def output_ids(pb, response) -> list[int]:
    """The new tokens of one response: output_ids [1, 1, n] cut at sequence_length [1, 1]."""
    ids = pb.get_output_tensor_by_name(response, "output_ids").as_numpy().reshape(-1)
    length = int(pb.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
    return ids[:min(length, ids.size)].tolist()
