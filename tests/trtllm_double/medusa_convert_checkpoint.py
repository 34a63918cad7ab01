"""Double of examples/medusa/convert_checkpoint.py: parses like upstream's argparse (names and choices from
specdeploy's upstream table; upstream's integer defaults), refuses what it asserts, and reads the heads as it does:
medusa_num_layers from the heads' config.json, the head count from the command line (its default 4 always wins over
the config), every head's weights from medusa_lm_head.safetensors, and the weight-only quantization it records in
config.json (examples/medusa/convert_checkpoint.py @ b93e14ca). Like upstream it fails on a base whose config ties
the output head to the embeddings: `convert_hf_llama` (tensorrt_llm/models/medusa/weight.py, the 1.2-era copy)
takes `lm_head` from `dict(hf_model.named_parameters())` whatever the tie, and transformers lists a tied head only
under the embeddings, so the lookup raises KeyError 'lm_head.weight'."""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdeploy.build.trtllm.upstream import MEDUSA_CONVERT_FLAGS

DEFAULTS = {"--num_medusa_heads": 4, "--num_medusa_layers": 1, "--max_medusa_token_len": 63, "--tp_size": 1,
            "--pp_size": 1, "--workers": 1}

def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py")
    for flag, allowed in MEDUSA_CONVERT_FLAGS.items():
        if flag in DEFAULTS:
            parser.add_argument(flag, type=int, default=DEFAULTS[flag])
        elif allowed == "switch":
            parser.add_argument(flag, action="store_true")
        elif flag == "--weight_only_precision":  # upstream: nargs='?', const and default 'int8'
            parser.add_argument(flag, nargs="?", const="int8", default="int8", choices=allowed)
        else:
            parser.add_argument(flag, choices=allowed if isinstance(allowed, tuple) else None,
                                default="float16" if flag == "--dtype" else None)
    parser.add_argument("--model_type", default="llama")
    return parser


def quant_algo(args: argparse.Namespace) -> str | None:
    """Upstream's config: W8A16 or W4A16 under --use_weight_only, otherwise none (int4_gptq: W4A16_GPTQ whatever the
    switch says)."""
    if args.weight_only_precision == "int4_gptq":
        return "W4A16_GPTQ"
    if not args.use_weight_only:
        return None
    return {"int8": "W8A16", "int4": "W4A16"}[args.weight_only_precision]


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    assert args.model_type in ["llama", "mixtral", "qwen2"], "Invalid model type"
    if args.medusa_model_dir:
        assert args.max_medusa_token_len > 0, "should have max_medusa_token_len > 0"
    heads_dir = Path(args.medusa_model_dir)
    layers = json.loads((heads_dir / "config.json").read_text())["medusa_num_layers"]
    weights = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
    for head in range(args.num_medusa_heads):  # a head the file lacks: upstream's load_medusa_hf raises KeyError
        for layer in range(layers):
            weights[f"{head}.{layer}.linear.weight"], weights[f"{head}.{layer}.linear.bias"]  # noqa: B018
        weights[f"{head}.{layers}.weight"]  # noqa: B018
    base = json.loads((Path(args.model_dir) / "config.json").read_text())
    if base.get("tie_word_embeddings", False):  # named_parameters() lists a tied head only as the embeddings
        raise KeyError("lm_head.weight")
    output = Path(args.output_dir)
    output.mkdir(parents=True)
    for rank in range(args.tp_size * args.pp_size):
        save_file({"placeholder": torch.zeros(1)}, str(output / f"rank{rank}.safetensors"))
    (output / "config.json").write_text(json.dumps({"architecture": "MedusaForCausalLM",
                                                    "num_medusa_heads": args.num_medusa_heads,
                                                    "max_draft_len": args.max_medusa_token_len,
                                                    "quantization": {"quant_algo": quant_algo(args),
                                                                     "kv_cache_quant_algo": None},
                                                    "mapping": {"world_size": args.tp_size * args.pp_size}}))


if __name__ == "__main__":
    main(sys.argv[1:])
