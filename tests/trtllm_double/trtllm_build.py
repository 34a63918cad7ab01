"""Double of trtllm-build (installed as bin/trtllm-build by the tests). It parses like upstream's argparse (flag names
and choices from specdeploy's upstream table, integers where upstream's are), refuses what upstream refuses and
adjusts what upstream adjusts (tests/trtllm_double/README.md cites each), and writes config.json with the
`build_config` the executor reads, plus one rank<r>.engine per checkpoint rank."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specdeploy.build.trtllm.upstream import TRTLLM_BUILD_FLAGS

GPU_SM_VARIABLE = "TRTLLM_DOUBLE_SM"  # the compute capability of the GPU the double builds on (90: an H100)
WEIGHT_ONLY_ALGOS = {"W4A16", "W8A16", "W4A16_AWQ", "W4A16_GPTQ"}  # QuantMode's int4/int8 weight-only
INTEGER_FLAGS = {"--max_batch_size", "--max_input_len", "--max_seq_len", "--max_num_tokens", "--max_beam_width",
                 "--workers", "--max_draft_len"}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-build")
    for flag, allowed in TRTLLM_BUILD_FLAGS.items():
        if allowed == "switch":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, choices=allowed if isinstance(allowed, tuple) else None,
                                type=int if flag in INTEGER_FLAGS else str)
    return parser


def build_config(argv: list[str], checkpoint_config: dict | None = None) -> dict:
    """The engine's build_config as upstream's build writes it for these flags (SystemExit 2 on a bad flag, as
    argparse; RuntimeError on what commands/build.py refuses). checkpoint_config: the checkpoint's config.json."""
    args = parser().parse_args(argv)
    max_draft_len = args.max_draft_len or 0
    if args.gather_context_logits and max_draft_len > 0:  # commands/build.py main()
        raise RuntimeError("Gather context logits is not support with draft len > 0. If want to get the accepted "
                           "tokens' logits from target model, please just enable gather_generation_logits")
    batch = args.max_batch_size or 2048
    max_seq_len = args.max_seq_len or 2048
    max_input_len = min(args.max_input_len or 1024, max_seq_len)  # _init_max_seq_len clips it, with a warning
    max_num_tokens = args.max_num_tokens or 8192
    mode = args.speculative_decoding_mode
    if max_draft_len == 0 and checkpoint_config and checkpoint_config.get("max_draft_len"):
        max_draft_len = checkpoint_config["max_draft_len"]  # builder.build: a Medusa checkpoint brings its own
    if mode is not None:  # builder.build: "Increasing max_seq_len ... by max_draft_len"
        max_seq_len += max_draft_len
        max_num_tokens = max(max_num_tokens, batch * (max_draft_len + 1))
    max_num_tokens = min(max_num_tokens, max_seq_len * batch)  # _common.check_max_num_tokens
    return {"max_batch_size": batch, "max_input_len": max_input_len, "max_seq_len": max_seq_len,
            "max_num_tokens": max_num_tokens, "max_draft_len": max_draft_len if mode else 0,
            "speculative_decoding_mode": mode, "gather_generation_logits": args.gather_generation_logits,
            "use_paged_context_fmha": args.use_paged_context_fmha != "disable"}


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    checkpoint = Path(args.checkpoint_dir)
    ranks = sorted(checkpoint.glob("rank*.safetensors"))
    if not ranks or not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint}: no TensorRT-LLM checkpoint (config.json and rank*.safetensors)")
    pretrained = json.loads((checkpoint / "config.json").read_text())
    config = build_config(argv, pretrained)
    sm = int(os.environ.get(GPU_SM_VARIABLE, "90"))
    if 100 <= sm < 120 and (pretrained.get("quantization") or {}).get("quant_algo") in WEIGHT_ONLY_ALGOS:
        raise RuntimeError("INT8/INT4 quantization is not supported on SM>=100.")  # builder.py @ 008b2b8d, build()
    output = Path(args.output_dir)
    output.mkdir(parents=True)
    for rank in ranks:
        (output / rank.name.replace(".safetensors", ".engine")).write_bytes(b"engine")
    (output / "config.json").write_text(json.dumps({"version": "1.2.1", "pretrained_config": pretrained,
                                                    "build_config": config}))


if __name__ == "__main__":
    main(sys.argv[1:])
