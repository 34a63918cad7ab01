"""Shared fixtures: tiny random Llama checkpoints with a character tokenizer, built in milliseconds, and the
embedded SmolLM2 engine (fp32) built once per session. The helpers they and the tests use are in tests/helpers/."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Builds compile no step programs (AOTInductor, a minute or two per real model: tune/step_programs.py) unless a
# test asks: tests/tune/test_step_programs.py builds and serves them, with greedy text equal to eager's.
os.environ.setdefault("SPECDEPLOY_STEPS", "eager")
# and keep the programs they compile in a store of their own (tune/program_store.py), not the user's
os.environ.setdefault("SPECDEPLOY_PROGRAMS", tempfile.mkdtemp(prefix="specdeploy-test-programs-"))
# One GGUF conversion store for the run (build/gguf_store.py): every SmolLM2 build after the first reads its
# conversion instead of parsing the GGUF again. Set before xdist starts its workers, so they share it.
os.environ.setdefault("SPECDEPLOY_CHECKPOINTS", tempfile.mkdtemp(prefix="specdeploy-test-checkpoints-"))
TEST_STORES = {name: os.environ[name] for name in ("SPECDEPLOY_PROGRAMS", "SPECDEPLOY_CHECKPOINTS")}
pytest.register_assert_rewrite("helpers")  # the helpers' asserts explain their failures as the tests' own do

from helpers.pipelines import tiny_pipeline, write_pipeline  # noqa: E402
from helpers.repo import REPO  # noqa: E402
from helpers.tiny_models import char_tokenizer, save_tiny_checkpoint  # noqa: E402


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker gets its share of the cores as torch threads,
    and so do the servers and builds it starts: two workers of two OpenMP threads on two cores wait on each other's
    descheduled threads at every parallel region."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_unconfigure(config) -> None:
    """The run's stores go with it (about 550 MB for SmolLM2's conversion); the workers leave them to the run's
    controlling process, which ends last. A store the caller named is theirs to keep."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for path in TEST_STORES.values():
        if Path(path).name.startswith("specdeploy-test-"):
            shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with slow tests first, then those that load SmolLM2, each file's tests kept together and in order: the
    two workers, which take a file at a time, then end together instead of one running a slow file alone at the
    end (`make test` keeps this order with --no-loadscope-reorder)."""
    def weight(marker: str) -> set:
        return {item.path for item in items if item.get_closest_marker(marker)}

    slow, smollm2 = weight("slow"), weight("smollm2")
    items.sort(key=lambda item: (item.path not in slow, item.path not in smollm2))


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run shares (the session's own temporary folder without xdist): engines
    built there once are reused by the other workers, the builder's lock and up-to-date check deciding who builds."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = save_tiny_checkpoint(root / "target", seed=0)
    return {
        "target": target,
        "draft": save_tiny_checkpoint(root / "draft", seed=1, base=target, noise=0.3),
        "other_vocab": save_tiny_checkpoint(root / "other_vocab", seed=2, tokenizer=char_tokenizer(128, 7)),
        "smaller_vocab": save_tiny_checkpoint(root / "smaller_vocab", seed=3, vocab_size=112),
    }


@pytest.fixture(scope="session")
def tiny_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, object]:
    """Loaded tiny engines: draft_target (noisy fp32 draft), int4 and int8 (derived drafts), ngram, int4_target (an
    int4 target with n-gram speculation), heuristic (noisy draft, adaptive proposal length)."""
    from specdeploy.build.torch_engine import build
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.pipeline import load_pipeline

    root = tmp_path_factory.mktemp("tiny-engines")
    specs = {
        "draft_target": tiny_pipeline(root, "tiny-dt", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"]),
        "int4": tiny_pipeline(root, "tiny-int4", tiny_checkpoints["target"]),
        "int8": tiny_pipeline(root, "tiny-int8", tiny_checkpoints["target"], derive="int8"),
        "ngram": tiny_pipeline(root, "tiny-ngram", tiny_checkpoints["target"], method="ngram"),
        "int4_target": tiny_pipeline(root, "tiny-int4-target", tiny_checkpoints["target"], method="ngram",
                                     dtype="bfloat16", target_weight_only="int4"),
        "heuristic": tiny_pipeline(root, "tiny-heuristic", tiny_checkpoints["target"],
                                   draft=tiny_checkpoints["draft"], schedule="heuristic"),
    }
    return {key: Engine(build(load_pipeline(path), root / "engines", quiet=True).directory)
            for key, path in specs.items()}


@pytest.fixture(scope="session")
def smollm2_fp32_engines(shared_root) -> dict[str, object]:
    """SmolLM2-135M-Instruct in fp32 (for exactness), built once per run and loaded for both shipped methods."""
    from specdeploy.build.torch_engine import build
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.pipeline import load_pipeline

    root = shared_root / "smollm2"
    root.mkdir(exist_ok=True)
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-draft-target.yaml").read_text())
    spec["name"] = "smollm2-fp32"
    spec["target"]["dtype"] = "float32"
    engine_dir = build(load_pipeline(write_pipeline(root / "fp32.yaml", **spec)), root / "engines",
                       quiet=True).directory
    return {"draft-target": Engine(engine_dir), "ngram": Engine(engine_dir, method="ngram")}


@pytest.fixture(scope="session")
def smollm2_bf16_engine_dir(shared_root) -> Path:
    """The shipped n-gram pipeline with a dense bf16 target (its matmuls are oneDNN's bf16 kernels, where the batch
    and speculation change a row's last bits) built for batch-invariant serving, gamma capped at 8 instead of
    measured at build; a test loads it in either serving.determinism (Engine's `determinism`)."""
    from specdeploy.build.torch_engine import build
    from specdeploy.spec.pipeline import load_pipeline

    root = shared_root / "smollm2-bf16"
    root.mkdir(exist_ok=True)
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-ngram.yaml").read_text())
    spec["name"] = "smollm2-bf16-invariant"
    spec["target"].pop("weight_only")
    spec["serving"] = {"policy": {"gamma_cap": 8}, "determinism": "batch_invariant"}
    return build(load_pipeline(write_pipeline(root / "bf16.yaml", **spec)), root / "engines", quiet=True).directory


@pytest.fixture(scope="module")
def single_thread():
    """Ops on ~1e5-element tensors gain nothing from intra-op threads; on a loaded 2-core box threads cost ~3x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
