"""The early exit's adapter: one small residual block between the states entering the exit layer and the target's
final norm, trained (`specdeploy train-exit-adapter`) so the target's own head reads them more like it reads its
last layer's, as Kangaroo's adapter does.

    adapter(h) = h + W_down · silu(W_up · rmsnorm(h))        h: [..., H], W_up: [I, H], W_down: [H, I]

W_down starts at zero, so an untrained adapter is exactly the plain early exit. The block is position-wise by
design: Kangaroo's adapter has an attention layer, which would need a KV cache of its own (a third bookkeeping path
beside the target's two, models/kv_cache.py); a position-wise block reads one position's state and nothing else, so
the draft's keys and values stay the target's own. A plain SiLU MLP rather than a SwiGLU: a single block on a
fixed input needs no gate to train, and two matrices cost a third less per drafted token than three.

Files (a folder): model.safetensors (`norm.weight` [H], `up.weight` [I, H], `down.weight` [H, I]) and config.json
recording the sizes, the exit layer it was trained at and the target it was trained for; a mismatched adapter is
refused naming the file and the mismatch. The build copies it into the engine's `exit_adapter` folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdeploy.errors import SpecdeployError
from specdeploy.spec.checkpoint import CheckpointSpec
from specdeploy.spec.speculation import EXIT_ADAPTER

ADAPTER_DIR = EXIT_ADAPTER.folder  # the folder in an engine
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REPORT_FILE = "training.json"  # train-exit-adapter's held-out report, copied by the build


def target_name(checkpoint: CheckpointSpec) -> str:
    """The name an adapter records for the target it was trained for: its checkpoint's file or folder name (a GGUF
    file's name says its quantization too, whose states differ)."""
    return Path(checkpoint.path).name


@dataclass(frozen=True)
class ExitAdapterConfig:
    hidden_size: int
    inner_size: int
    exit_layer: int  # the layer whose input states it was trained on
    target: str  # the target checkpoint's file or folder name it was trained for
    target_layers: int  # that target's layer count
    rms_norm_eps: float = 1e-5

    @staticmethod
    def read(folder: Path) -> ExitAdapterConfig:
        """The folder's config.json; an error naming the file when it is missing or incomplete."""
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise SpecdeployError(f"{path}: not found (an exit adapter is a folder with {CONFIG_FILE} and "
                                  f"{WEIGHTS_FILE}; train one with specdeploy train-exit-adapter)")
        data = json.loads(path.read_text())
        try:
            return ExitAdapterConfig(hidden_size=data["hidden_size"], inner_size=data["inner_size"],
                                     exit_layer=data["exit_layer"], target=data["target"],
                                     target_layers=data["target_layers"], rms_norm_eps=data.get("rms_norm_eps", 1e-5))
        except KeyError as exc:
            raise SpecdeployError(f"{path}: not an exit adapter's config, {exc.args[0]!r} is missing") from None

    def mismatch(self, target: str, target_layers: int, hidden_size: int, exit_layer: int) -> str | None:
        """What differs from the target and exit layer it would be used with, in words; None when it fits."""
        if hidden_size != self.hidden_size:
            return f"it is for hidden size {self.hidden_size}, the target's is {hidden_size}"
        if target_layers != self.target_layers or target != self.target:
            return (f"it was trained for {self.target} ({self.target_layers} layers), the target is {target} "
                    f"({target_layers} layers)")
        if exit_layer != self.exit_layer:
            return (f"it was trained at exit layer {self.exit_layer}, speculation.early_exit.exit_layer is "
                    f"{exit_layer}")
        return None


class ExitAdapter(nn.Module):
    """The residual block of the module docstring, position-wise: [..., H] → [..., H]."""

    def __init__(self, config: ExitAdapterConfig) -> None:
        super().__init__()
        self.config = config
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.up = nn.Linear(config.hidden_size, config.inner_size, bias=False)
        self.down = nn.Linear(config.inner_size, config.hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)  # untrained: exactly the plain early exit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: the raw states entering the exit layer [..., H] → the adapted states [..., H], for the final norm."""
        normed = F.rms_norm(h, (h.shape[-1],), self.norm.to(h.dtype), self.config.rms_norm_eps)
        return h + self.down(F.silu(self.up(normed)))

    def state(self) -> dict[str, torch.Tensor]:
        return {"norm.weight": self.norm.detach().float().contiguous(),
                "up.weight": self.up.weight.detach().float().contiguous(),
                "down.weight": self.down.weight.detach().float().contiguous()}

    def save(self, folder: Path) -> None:
        """config.json and model.safetensors (fp32: 2HI + H numbers, a few MB) in `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.state(), str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @staticmethod
    def from_state(config: ExitAdapterConfig, state: dict[str, torch.Tensor], source: str) -> ExitAdapter:
        """An adapter of `config` with `state`'s tensors; an error naming `source` when a tensor is missing or of
        another shape."""
        adapter = ExitAdapter(config)
        h, i = config.hidden_size, config.inner_size
        expected = {"norm.weight": (h,), "up.weight": (i, h), "down.weight": (h, i)}
        for name, shape in expected.items():
            if name not in state:
                raise SpecdeployError(f"{source}: no tensor {name!r} (not an exit adapter's weights)")
            if tuple(state[name].shape) != shape:
                raise SpecdeployError(f"{source}: {name} is {list(state[name].shape)}, its config.json says "
                                      f"{list(shape)}")
        with torch.no_grad():
            adapter.norm.copy_(state["norm.weight"])
            adapter.up.weight.copy_(state["up.weight"])
            adapter.down.weight.copy_(state["down.weight"])
        return adapter

    @staticmethod
    def load(folder: Path, target: str, target_layers: int, hidden_size: int, exit_layer: int) -> ExitAdapter:
        """The adapter in `folder`, refused (naming its config.json and the mismatch) unless it was trained for
        this target at this exit layer."""
        folder = Path(folder)
        config = ExitAdapterConfig.read(folder)
        problem = config.mismatch(target, target_layers, hidden_size, exit_layer)
        if problem is not None:
            raise SpecdeployError(f"{folder / CONFIG_FILE}: this exit adapter does not fit: {problem}")
        weights = folder / WEIGHTS_FILE
        if not weights.is_file():
            raise SpecdeployError(f"{weights}: not found (an exit adapter's weights)")
        return ExitAdapter.from_state(config, load_file(str(weights)), str(weights))
