"""The early-exit layer a pipeline asks to be measured (speculation.early_exit.exit_layer: measured).

A deeper exit drafts tokens the target agrees with more often and costs more per drafted token, and both depend on
the model and the machine, so the layer is measured where the engine runs: the calibration prompts
(tune/calibration.py) decoded plain and with an early exit at each layer count of the pipeline's sweep, side by side
in one run, and the layer with the best realized speedup is written into the engine (engine_paths.
MEASURED_EXIT_FILE), which serves with it from then on. When no layer beats plain decode the best one is still
written, with the measurement saying so (a draft-free model's early layers rarely agree with its last without
training for it: docs/early-exit.md).
"""

from __future__ import annotations

import time
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.models import machine
from specdeploy.models.registry import component_config
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import MEASURED_EXIT_FILE, engine_pipeline, write_json
from specdeploy.tune.calibration import CALIBRATION_TOKENS, calibrate, calibration_prompts


def swept_layers(engine_dir: Path, num_layers: int) -> list[int]:
    """The pipeline's sweep, limited to layer counts below the target's."""
    sweep = engine_pipeline(engine_dir).speculation.early_exit.sweep
    layers = sorted({layer for layer in sweep if layer < num_layers})
    if not layers:
        raise SpecdeployError(f"{engine_dir}: speculation.early_exit.sweep {list(sweep)} has no layer count below "
                              f"the target's {num_layers} layers")
    return layers


def measure_exit_layer(engine_dir: Path, quiet: bool = False) -> str:
    """Decode the calibration prompts at every swept exit layer, write the best into the engine; returns what it
    picked, in a sentence."""
    config, _ = component_config(Path(engine_dir) / "target")
    layers = swept_layers(engine_dir, config.num_layers)
    engines = [Engine(engine_dir, exit_layer=layer) for layer in layers]
    prompts = calibration_prompts(engines[0])
    runs = calibrate(engines, prompts, CALIBRATION_TOKENS, quiet=quiet)
    by_layer = {layer: run.speedup() for layer, run in zip(layers, runs)}
    best = max(by_layer, key=by_layer.__getitem__)
    measured = {"exit_layer": best, "beats_plain": by_layer[best] > 1,
                "realized_speedup_by_layer": {str(layer): by_layer[layer] for layer in layers},
                "mean_accepted_length_by_layer": {str(layer): run.mean_accepted_length()
                                                  for layer, run in zip(layers, runs)},
                "draft_cost_ratio_by_layer": {str(layer): run.draft_cost_ratio() for layer, run in zip(layers, runs)},
                "prompts": len(prompts), "max_tokens": CALIBRATION_TOKENS, "machine": machine.describe(),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = Path(engine_dir) / MEASURED_EXIT_FILE
    write_json(path, measured)
    sweep = ", ".join(f"{layer}: {speedup:.2f}x" for layer, speedup in by_layer.items())
    verdict = "" if by_layer[best] > 1 else " (no exit layer beats plain decode here)"
    return (f"exit layer {best}: {by_layer[best]:.2f}x plain decode{verdict} (realized by layer: {sweep}); written "
            f"to {path}")
