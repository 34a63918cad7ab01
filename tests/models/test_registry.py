"""Loading an engine component: its tensors read one at a time, the model equal to one built from the whole file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specdeploy.models.registry import DTYPES, TensorsOnAccess, component_config, load_component, model_class


@pytest.mark.parametrize("engine", ["draft_target", "int4_target"])
def test_a_component_read_tensor_by_tensor_builds_the_model_the_whole_file_builds(tiny_engines, engine):
    """bf16/fp32 weights and the int4 target's codes, scales and minimums alike."""
    directory = tiny_engines[engine].dir / "target"
    whole = load_file(str(directory / "model.safetensors"))
    on_access = TensorsOnAccess(directory / "model.safetensors")
    assert sorted(on_access) == sorted(whole) and len(on_access) == len(whole)
    assert all(torch.equal(on_access[name], tensor) and on_access[name].dtype == tensor.dtype
               for name, tensor in whole.items())
    assert "no.such.tensor" not in on_access
    with pytest.raises(KeyError, match="no.such.tensor"):
        on_access["no.such.tensor"]
    config, dtype = component_config(directory)
    reference = model_class(config.architecture)(config, whole, DTYPES[dtype]).eval()
    loaded = load_component(directory)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        expected = reference.logits(reference(tokens, positions, reference.new_cache(1, 8)).hidden)
        got = loaded.logits(loaded(tokens, positions, loaded.new_cache(1, 8)).hidden)
    assert torch.equal(got, expected)
