"""Double of examples/medusa/convert_checkpoint.py: checks its inputs as upstream reads them."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdeploy.builders.trtllm_upstream import MEDUSA_CONVERT_FLAGS

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert set(args) <= set(MEDUSA_CONVERT_FLAGS), sorted(set(args) - set(MEDUSA_CONVERT_FLAGS))
heads_dir = Path(args["--medusa_model_dir"])
heads_config = json.loads((heads_dir / "config.json").read_text())
heads, layers = int(args["--num_medusa_heads"]), heads_config["medusa_num_layers"]
weights = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
for head in range(heads):
    for layer in range(layers):
        assert f"{head}.{layer}.linear.weight" in weights and f"{head}.{layer}.linear.bias" in weights
    assert f"{head}.{layers}.weight" in weights
assert (Path(args["--model_dir"]) / "config.json").is_file()
output = Path(args["--output_dir"])
output.mkdir(parents=True)
world = int(args["--tp_size"]) * int(args["--pp_size"])
for rank in range(world):
    save_file({"placeholder": torch.zeros(1)}, str(output / f"rank{rank}.safetensors"))
(output / "config.json").write_text(json.dumps({"architecture": "MedusaForCausalLM", "num_medusa_heads": heads,
                                                "max_draft_len": int(args["--max_medusa_token_len"])}))
