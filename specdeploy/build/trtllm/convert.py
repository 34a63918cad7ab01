"""Convert a Hugging Face Llama or Mixtral checkpoint into a TensorRT-LLM checkpoint, one rank file per GPU,
through TensorRT-LLM's Python API: the same calls its examples/models/core/llama/convert_checkpoint.py makes
(Mixtral maps to LLaMAForCausalLM). Run by the trtllm build plan as
`python -m specdeploy.build.trtllm.convert --model_dir HF --output_dir OUT --dtype bfloat16 --tp_size 4 ...`;
it needs TensorRT-LLM (facts: docs/tensorrt-llm.md)."""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdeploy.build.trtllm.convert")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], required=True)
    for name in ("tp_size", "pp_size", "moe_tp_size", "moe_ep_size"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--use_weight_only", action="store_true")
    parser.add_argument("--weight_only_precision", choices=["int4", "int8"], default="int8")
    return parser.parse_args(argv)


def convert(args: argparse.Namespace) -> None:
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import LLaMAForCausalLM
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    # weight-only without calibration: W4A16 or W8A16 (per channel), what upstream's --weight_only_precision picks
    algorithm = {"int4": QuantAlgo.W4A16, "int8": QuantAlgo.W8A16}[args.weight_only_precision]
    quant = QuantConfig(quant_algo=algorithm) if args.use_weight_only else QuantConfig()
    world_size = args.tp_size * args.pp_size
    for rank in range(world_size):
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=args.tp_size, pp_size=args.pp_size,
                          moe_tp_size=args.moe_tp_size, moe_ep_size=args.moe_ep_size)
        model = LLaMAForCausalLM.from_hugging_face(args.model_dir, args.dtype, mapping=mapping, quant_config=quant)
        model.save_checkpoint(args.output_dir, save_config=rank == 0)
        del model


if __name__ == "__main__":
    convert(parse(sys.argv[1:]))
