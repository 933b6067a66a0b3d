"""The rules of the provider conformance kit (cli/conformance.py), by their stable
names: what a run prints one line for, and what docs/providers.md lists."""

from __future__ import annotations

from typing import Final

__all__ = ["RULES"]

RULES: Final = {
    "probe.accepts": "probe accepts the given plan (`ok` true)",
    "probe.refuses_unknown_image": "probe refuses an image it does not offer, with a code",
    "probe.refuses_unknown_isolation": "probe refuses an isolation it does not offer, with a code",
    "probe.refuses_unknown_network": "probe refuses a network it does not offer, with a code",
    "batch.probe_64": "a 64-row probe answers each row for itself, in order",
    "prepare.check_refusal": "when check() refuses midway, prepare stops, refuses the row with"
    " check()'s code and leaves the provider directory empty and the slot account idle",
    "prepare.calls_check": "prepare calls check() before it prepares",
    "prepare.result": "prepare returns a prepare result the host accepts for the plan",
    "start.reply": "start answers `started` for an argv running in the host's service",
    "observe.phases": "observe goes waiting -> ready -> payload (the barrier's PID, in the"
    " service) -> finished with the payload's exit code, never backwards",
    "observe.repeatable": "observing a finished attempt again gives the same reply",
    "batch.observe_64": "a 64-row observe gives every row the one-row reply",
    "stop.repeatable": "stop can be repeated",
    "release.clean": "release leaves the provider directory empty and the slot account idle",
    "release.repeatable": "release can be repeated and stays clean",
    "stop.running": "stop of a running payload: the service is then empty, the account idle,"
    " and its release leaves the provider directory empty",
    "limits.minimum_runs": "a plan at exactly the minimum limits the driver states"
    " (`minimum_limits()`) runs the quick payload to exit 0 (nothing stated: nothing to run)",
}
"""Every rule the kit checks, by its stable name."""
