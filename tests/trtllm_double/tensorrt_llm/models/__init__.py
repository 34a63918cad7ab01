"""LLaMAForCausalLM, which upstream also uses for MixtralForCausalLM (tensorrt_llm/models/__init__.py)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ARCHITECTURES = {"LlamaForCausalLM", "MixtralForCausalLM"}


class LLaMAForCausalLM:
    @classmethod
    def from_hugging_face(cls, hf_model_or_dir, dtype="auto", mapping=None, quant_config=None, **kwargs):
        directory = Path(hf_model_or_dir)
        config = json.loads((directory / "config.json").read_text())
        if config["architectures"][0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {config['architectures']}")
        weights = {}  # every *.safetensors in the directory, as upstream's ModelWeightsLoader globs them
        for shard in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(str(shard)))
        layer = "model.layers.0."
        if config["architectures"][0] == "MixtralForCausalLM":  # the per-expert layout upstream converts
            assert f"{layer}block_sparse_moe.gate.weight" in weights
            assert f"{layer}block_sparse_moe.experts.0.w1.weight" in weights
        else:
            assert f"{layer}mlp.gate_proj.weight" in weights
        model = cls()
        model.config = {"architecture": config["architectures"][0], "dtype": dtype,
                        "num_hidden_layers": config["num_hidden_layers"], "mapping": mapping.to_dict(),
                        "quantization": {"quant_algo": quant_config.quant_algo}}
        model.rank = mapping.rank
        return model

    def save_checkpoint(self, output_dir, save_config=True):
        output = Path(output_dir)
        output.mkdir(parents=True, exist_ok=True)
        save_file({"placeholder": torch.zeros(1)}, str(output / f"rank{self.rank}.safetensors"))
        if save_config:
            (output / "config.json").write_text(json.dumps(self.config, indent=2))
