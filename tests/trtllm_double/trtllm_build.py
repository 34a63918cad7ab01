"""Double of trtllm-build (installed as bin/trtllm-build by the tests): every flag must be upstream's."""

import json
import sys
from pathlib import Path

from specdeploy.builders.trtllm_upstream import TRTLLM_BUILD_FLAGS

argv, flags = sys.argv[1:], {}
for index, word in enumerate(argv):
    if word.startswith("--"):
        value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
        allowed = TRTLLM_BUILD_FLAGS[word]  # KeyError: not an upstream flag
        assert (value is None) == (allowed == "switch"), word
        assert not isinstance(allowed, tuple) or value in allowed, (word, value)
        flags[word] = value
checkpoint = Path(flags["--checkpoint_dir"])
ranks = sorted(checkpoint.glob("rank*.safetensors"))
assert ranks and (checkpoint / "config.json").is_file()
output = Path(flags["--output_dir"])
output.mkdir(parents=True)
for rank in ranks:
    (output / rank.name.replace(".safetensors", ".engine")).write_bytes(b"engine")
(output / "config.json").write_text(json.dumps({"build_config": flags, "pretrained_config":
                                                json.loads((checkpoint / "config.json").read_text())}))
