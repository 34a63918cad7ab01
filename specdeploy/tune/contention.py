"""Whether a build's timing ran on a machine busy with other work, and the conditions recorded beside a decision.

A build chooses from timings: a step program or eager (tune/step_programs.py), a gamma cap (tune/gamma_cap.py).
With other work on the machine a build here timed a target step at 724 ms compiled against 704 ms eager, about
25× the quiet figure, and chose eager from that noise. Two signs give such a timing away:

- CPU share: the CPU seconds the process got over the wall seconds its threads could have run
  (`process_time / (wall · threads)`). torch's threads run (or spin) through a step, so alone the share is near 1;
  descheduled by other processes, it falls. Below MIN_CPU_SHARE the machine was contended.
- Rounds that disagree: the timed rounds of one model spread by more than MAX_SPREAD of their median (interquartile
  range over the median). A quiet machine repeats a step within a few percent.

A contended timing is taken again (ATTEMPTS in all); when every attempt was contended, the decision falls back to
its step's stated rule and says so. Either way the conditions of every attempt are written beside the decision.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

MIN_CPU_SHARE = 0.75
MAX_SPREAD = 0.25
ATTEMPTS = 3
PAUSE_SECONDS = 5.0  # between attempts: a burst of other work may pass


@dataclass(frozen=True)
class Conditions:
    """How one timing ran: its wall and CPU seconds, torch's threads, the CPU share, the widest spread of rounds,
    and why it counts as contended (None: quiet)."""

    wall_seconds: float
    cpu_seconds: float
    threads: int
    cpu_share: float
    spread: float
    contended: str | None

    def as_record(self) -> dict:
        return asdict(self)


def spread(rounds: list[float]) -> float:
    """Interquartile range over the median of one model's timed rounds (0 for fewer than 4)."""
    if len(rounds) < 4:
        return 0.0
    low, _, high = statistics.quantiles(rounds, n=4)
    return (high - low) / statistics.median(rounds)


def judge(wall_seconds: float, cpu_seconds: float, threads: int, rounds: dict[str, list[float]]) -> Conditions:
    """The conditions of a timing from its clocks and each model's rounds (any unit)."""
    share = cpu_seconds / (wall_seconds * threads) if wall_seconds > 0 else 1.0
    widest = max((spread(times) for times in rounds.values()), default=0.0)
    why = None
    if share < MIN_CPU_SHARE:
        why = f"the process got {share:.0%} of the CPU its {threads} threads could use (under {MIN_CPU_SHARE:.0%})"
    elif widest > MAX_SPREAD:
        why = f"its rounds disagree: interquartile range {widest:.0%} of the median (over {MAX_SPREAD:.0%})"
    return Conditions(round(wall_seconds, 3), round(cpu_seconds, 3), threads, round(share, 3), round(widest, 3), why)


class Watch:
    """Wall and process CPU seconds over a block (`with Watch() as watch:`); the clocks can be replaced in tests."""

    def __init__(self, wall: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self.wall, self.cpu = wall, cpu
        self.wall_seconds = self.cpu_seconds = 0.0

    def __enter__(self) -> Watch:
        self._wall, self._cpu = self.wall(), self.cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_seconds = self.wall() - self._wall
        self.cpu_seconds = self.cpu() - self._cpu


def until_quiet(measure: Callable[[], dict], attempts: int = ATTEMPTS, pause: float = PAUSE_SECONDS,
                sleep: Callable[[float], None] = time.sleep) -> tuple[dict, list[dict]]:
    """Run `measure` (a timing whose result carries its "conditions", Conditions.as_record) until one is quiet or
    `attempts` ran; returns the last result and every attempt's conditions. A result without conditions (a failed
    phase) ends the attempts."""
    seen: list[dict] = []
    for attempt in range(attempts):
        result = measure()
        if "conditions" not in result:
            return result, seen
        seen.append(result["conditions"])
        if result["conditions"]["contended"] is None:
            break
        if attempt + 1 < attempts:
            sleep(pause)
    return result, seen
