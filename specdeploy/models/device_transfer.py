"""Host and device: host data onto the engine's device without a host sync, and timing work queued on a GPU.

A step builds a few small tensors from host-side lists (pending tokens, cache starts, tree parents). On a GPU,
`torch.tensor(data, device="cuda")` copies from pageable memory and then waits for the device's queue: a host sync per
call, several per decode step. Through pinned memory the copy is queued like a kernel and the step keeps its one sync
(the read of the outcome). PyTorch's pinned-memory allocator keeps a block until the copies queued from it are done.
"""

from __future__ import annotations

import time

import torch


def from_host(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (numbers or nested lists of them) as a tensor on `device`; dtype None infers it like torch.tensor."""
    if torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)


def finish(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, which runs it as it is called): what timing a GPU
    needs, since the host runs ahead of the kernels it queues."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Times the two phases of a decode step, draft then verify. The step ends with its host sync; on a GPU a host
    time stamp between the phases would only measure launches, so the draft phase is timed by CUDA events (read
    after that sync, with no sync of their own) and verify is the rest of the step."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.on_gpu:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record(torch.cuda.current_stream(self.device))

    def drafted(self) -> None:
        if self.on_gpu:
            self.drafted_event = torch.cuda.Event(enable_timing=True)
            self.drafted_event.record(torch.cuda.current_stream(self.device))
        else:
            self.drafted_at = time.perf_counter()

    def verified(self) -> tuple[float, float]:
        """(draft seconds, verify seconds), once the step's outcome has been read to the host."""
        total = time.perf_counter() - self.started
        if self.on_gpu:
            draft = self.start_event.elapsed_time(self.drafted_event) / 1000
        else:
            draft = self.drafted_at - self.started
        return draft, max(total - draft, 0.0)
