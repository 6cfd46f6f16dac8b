"""The forcing policies of ``meridian bench accuracy``: each one a set of request fields (the
table in :mod:`meridian.bench.accuracy`), parsed from ``--policies``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meridian.errors import MeridianError

__all__ = ["ForcingPolicy", "parse_forcing_policies"]


@dataclass(frozen=True, slots=True)
class ForcingPolicy:
    """One way to stop reasoning, as the request fields that select it; ``probe_interval``: the
    harness's EAT probe decides instead, every that many reasoning tokens."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    probe_interval: int | None = None


_XARGS = {
    "meridian": {},
    "eat": {"meridian_signals": "eat"},
    "rpdi": {"meridian_signals": "rpdi"},
    "none": {"meridian_forcing": "off"},
}


def parse_forcing_policies(text: str, probe_interval: int = 32) -> list[ForcingPolicy]:
    """``none,cap:64,128,hard-cap:256,meridian,eat-probe:8`` -> policies, in order (see the
    module table); ``eat-probe`` alone probes every ``probe_interval`` tokens."""
    policies: list[ForcingPolicy] = []
    kind = ""
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, value = part.partition(":")
        if name in _XARGS and not value:
            kind = ""
            policies.append(ForcingPolicy(name, {"vllm_xargs": dict(_XARGS[name])}))
            continue
        if name in ("cap", "hard-cap", "eat-probe"):
            kind = name
            value = value or (str(probe_interval) if name == "eat-probe" else "")
        elif kind in ("cap", "hard-cap") and not value and part.isdigit():
            value = part  # the next number of a sweep: cap:64,128
        else:
            raise MeridianError(
                f"--policies: unknown policy {part!r}; known: none, cap:N, hard-cap:N, meridian, "
                "eat, rpdi, eat-probe[:N]"
            )
        if not value.isdigit() or int(value) < 1:
            raise MeridianError(f"--policies: {kind} needs a positive token count; got {part!r}")
        count = int(value)
        fields: dict[str, Any] = {"vllm_xargs": dict(_XARGS["none"])}  # Meridian's forcing off
        if kind == "cap":
            fields["thinking_token_budget"] = count
        elif kind == "hard-cap":
            xargs = {"meridian_max_think_tokens": count, "meridian_signals": "none"}
            fields = {"vllm_xargs": xargs}
        probe_every = count if kind == "eat-probe" else None  # only the probe forces
        policies.append(ForcingPolicy(f"{kind}:{count}", fields, probe_every))
    names = [p.name for p in policies]
    if not names:
        raise MeridianError("--policies: no policy given")
    if len(set(names)) != len(names):
        raise MeridianError(f"--policies: a policy is listed twice: {', '.join(names)}")
    return policies
