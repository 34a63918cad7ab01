"""What an engine costs beside its decode rate: the bytes it stores and the seconds its build took (from what the
build recorded), and, in a fresh process as a server or a user's first run starts one, the seconds a load takes,
the first request's latency and the peak resident memory. llama.cpp's peak resident memory on the same GGUF is
measured the same way, so the two compare process to process (ours includes importing torch).

Each fresh process is this module run as a script (`python -m specdeploy.bench.footprint engine|llama-cpp ...`),
which prints its measurements as JSON; the llama.cpp one imports neither torch nor the engine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specdeploy.bench.results import Footprint
from specdeploy.errors import SpecdeployError
from specdeploy.spec.engine_paths import MANIFEST_FILE, MEASURED_POLICY_FILE, directory_bytes

if TYPE_CHECKING:
    from specdeploy.runtime.engine import Engine

TIMEOUT_S = 900  # a compiled engine's load traces its graphs again: about a minute on 2 cores


def recorded_seconds(path: Path, key: str) -> float | None:
    """A number a build step recorded in a JSON file, None when the file or the key is not there."""
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def run_fresh(*args: str) -> dict:
    """Run this module in a fresh Python process and return the JSON it prints."""
    command = [sys.executable, "-m", "specdeploy.bench.footprint", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SpecdeployError(f"measuring a fresh process ({' '.join(args[:2])}) failed: "
                              f"{done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_footprint(engine: Engine, prompt_ids: list[int], max_tokens: int) -> Footprint:
    """The footprint of `engine`'s directory, its fresh process running one request of `prompt_ids` on as many
    threads as this one; beside it llama.cpp's on the target's GGUF, where there is one and it is installed."""
    import torch

    from specdeploy.bench.peers import target_gguf
    from specdeploy.runtime.step_programs import programs_compile_seconds

    engine_dir, threads, ids = engine.dir, torch.get_num_threads(), json.dumps(prompt_ids)
    ours = run_fresh("engine", str(engine_dir), ids, str(max_tokens), str(threads))
    footprint = Footprint(
        engine_bytes=directory_bytes(engine_dir),
        build_seconds=recorded_seconds(engine_dir / MANIFEST_FILE, "build_seconds"),
        compile_seconds=programs_compile_seconds(engine_dir),
        gamma_cap_seconds=recorded_seconds(engine_dir / MEASURED_POLICY_FILE, "seconds"), **ours)
    gguf, why = target_gguf(engine)
    if gguf is None:
        footprint.llama_cpp_skipped = why
    elif importlib.util.find_spec("llama_cpp") is None:
        footprint.llama_cpp_skipped = "llama-cpp-python is not installed"
    else:
        peer = run_fresh("llama-cpp", str(gguf), ids, str(max_tokens), str(threads), str(engine.max_length + 1))
        footprint.llama_cpp_peak_rss_bytes = peer["peak_rss_bytes"]
    return footprint


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, its address space's high-water mark. Not getrusage's ru_maxrss,
    which Linux carries across fork and exec, so a child of a large process would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise SpecdeployError("/proc/self/status has no VmHWM: peak resident memory is measured on Linux only")


def engine_process(engine_dir: str, ids: list[int], max_tokens: int, threads: int) -> dict:
    """In the fresh process: load the engine, run one greedy request with its speculation, time both."""
    import torch

    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = Engine(engine_dir)
    loaded = time.perf_counter()
    first_token = None
    for _ in engine.generate(ids, SamplingParams(), max_tokens):
        if first_token is None:
            first_token = time.perf_counter()
    done = time.perf_counter()
    return {"load_seconds": loaded - started, "first_token_seconds": (first_token or done) - loaded,
            "first_request_seconds": done - loaded, "peak_rss_bytes": peak_rss_bytes()}


def llama_cpp_process(gguf: str, ids: list[int], max_tokens: int, threads: int, n_ctx: int) -> dict:
    """In the fresh process: load the GGUF with llama.cpp and decode the same request greedily."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    for count, _ in enumerate(llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0), 1):
        if count >= max_tokens:
            break
    return {"peak_rss_bytes": peak_rss_bytes()}


if __name__ == "__main__":
    kind, path, prompt, tokens, thread_count, *rest = sys.argv[1:]
    if kind == "engine":
        result = engine_process(path, json.loads(prompt), int(tokens), int(thread_count))
    else:
        result = llama_cpp_process(path, json.loads(prompt), int(tokens), int(thread_count), int(rest[0]))
    print(json.dumps(result))
