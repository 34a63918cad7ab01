"""Making a loaded model's linear layers batch invariant (serving.determinism: batch_invariant), see
row_invariance.py; its attention is row by row from construction (LlamaModel's row_invariant)."""

from __future__ import annotations

import torch
from torch import nn

from specdeploy.models.llama import DenseLinear, LlamaModel
from specdeploy.models.quantize import Int4Linear, Int8Linear, RescoredHead
from specdeploy.models.row_invariance import RowBlocks, invariant_rows

LINEAR_KINDS = (DenseLinear, Int4Linear, Int8Linear, RescoredHead, nn.Linear)


def in_features(layer: nn.Module) -> int:
    if isinstance(layer, RescoredHead):
        return layer.coarse.in_features
    if isinstance(layer, Int8Linear):
        return layer.weight_int8.shape[1]
    return layer.in_features


# A probe's verdict per (kind, in_features, weight shape, dtype, device, max_rows): engines loaded again in one
# process (tests, bench) probe each shape once.
_VERDICTS: dict[tuple, int] = {}


def make_batch_invariant(model: LlamaModel, max_rows: int) -> dict[str, int]:
    """Attend row by row, and probe each distinct linear layer (kind, shape) on this machine's kernels with up to
    `max_rows` rows: a layer whose rows change with their company above some count is wrapped in RowBlocks of
    that many rows. Returns the wrapped layers' names and block sizes (none where the kernels keep rows). The model
    must have been built to attend row by row (LlamaModel's row_invariant)."""
    if not model.row_invariant:
        raise ValueError("a batch-invariant model attends row by row: build it with row_invariant=True")
    blocked = {}
    dtype, device = model.dtype, model.embed.device
    for name, parent in list(model.named_modules()):
        for child_name, layer in list(parent.named_children()):
            if not isinstance(layer, LINEAR_KINDS) or isinstance(parent, RescoredHead):
                continue
            probe_dtype = layer.weight.dtype if isinstance(layer, nn.Linear) else dtype
            key = (type(layer), in_features(layer), tuple(_output_shape(layer)), probe_dtype, str(device), max_rows)
            if key not in _VERDICTS:
                _VERDICTS[key] = invariant_rows(layer, in_features(layer), probe_dtype, device, max_rows)
            if _VERDICTS[key] < max_rows:
                setattr(parent, child_name, RowBlocks(layer, _VERDICTS[key]))
                blocked[f"{name}.{child_name}" if name else child_name] = _VERDICTS[key]
    return blocked


def _output_shape(layer: nn.Module) -> torch.Size:
    """The layer's weight-like buffer's shape, telling layers of one kind apart."""
    for tensor in (*layer.buffers(), *layer.parameters()):
        return tensor.shape
    return torch.Size()
