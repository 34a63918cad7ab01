"""Write the first of each kind of specdeploy's shipped prompts (data/prompts.jsonl) to the file named by argv[1]:
the short prompt sets of scripts/gpu-check.sh and scripts/trtllm-check.sh."""

import json
import sys
from importlib import resources

seen, chosen = set(), []
for line in resources.files("specdeploy").joinpath("data/prompts.jsonl").read_text().splitlines():
    item = json.loads(line)
    if item["kind"] not in seen:
        seen.add(item["kind"])
        chosen.append(line)
with open(sys.argv[1], "w") as out:
    out.write("\n".join(chosen) + "\n")
