"""Test only: an exception injected into one proposer hook, to show what a failed scheduler does (issue 64).

SPECDEPLOY_TEST_FAULT=HOOK:N makes the Nth call of the served engine's proposer hook HOOK (prefill, propose,
observe, on_commit or move_row) raise InjectedFault; tests/serve/test_served_scheduler_failure.py sets it
on a tiny engine's server. Never set it on a server that serves anyone: it exists to break the server.
"""

from __future__ import annotations

import os

from specdeploy.speculative.proposer import Proposer

FAULT_VARIABLE = "SPECDEPLOY_TEST_FAULT"
HOOKS = ("prefill", "propose", "observe", "on_commit", "move_row")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


def inject_fault(proposer: Proposer, hook: str, call: int) -> None:
    """Make the `call`th call (1-based) of `proposer`'s `hook` raise InjectedFault; the calls before it, and after,
    run the hook as before."""
    if hook not in HOOKS or call < 1:
        raise ValueError(f"{FAULT_VARIABLE}: HOOK:N with HOOK one of {', '.join(HOOKS)} and N ≥ 1, got {hook}:{call}")
    original = getattr(proposer, hook)
    calls = 0

    def hooked(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call:
            raise InjectedFault(f"{hook} call {call} failed, as {FAULT_VARIABLE} asked (test only)")
        return original(*args, **kwargs)

    setattr(proposer, hook, hooked)


def inject_from_environment(proposer: Proposer) -> str | None:
    """Apply $SPECDEPLOY_TEST_FAULT (HOOK:N) to `proposer`. Returns its value, or None when it is not set."""
    value = os.environ.get(FAULT_VARIABLE)
    if not value:
        return None
    hook, _, call = value.partition(":")
    try:
        number = int(call)
    except ValueError:
        number = 0
    inject_fault(proposer, hook, number)
    return value
