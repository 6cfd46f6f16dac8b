"""What Meridian's router reads of an OpenAI request before it is placed (no Ray, no vLLM).

Ray Serve hands the router the request as the ingress received it: a chat or completion body,
not tokens. The router needs its kind and size (:class:`~meridian.core.routing.NewRequest`):

- **The kind**, from the prompt's tail, by the rules the replica's phase router applies to the
  tokens (:meth:`~meridian.core.format.ReasoningFormat.initial_phase`, built by the replica
  from the family's boundaries as :mod:`meridian.vllm.runtime` builds it), applied to the text:
  a prompt with ``/no_think`` (families that support it) answers; one ending with
  ``think_start`` thinks, one ending with ``think_end`` answers; one whose last
  ``think_start`` is not closed thinks (the reasoning started in the prompt); otherwise it
  thinks when the family's template opens the think block in the prompt
  (``think_starts_in_prompt``), else it is undecided (``PREFILL``: the model may open a block;
  counted as reasoning). A chat request's prompt is the template's rendering: its generation
  prompt opens the block for such families, and ``chat_template_kwargs`` with
  ``enable_thinking`` (Qwen3) or ``thinking`` (DeepSeek-V3.1) false closes it (the request
  answers). A completion whose prompt is token ids is undecided.
- **The prompt length**, estimated at :data:`CHARS_PER_TOKEN` characters a token (the router has
  no tokenizer; the prompt weighs little beside a reasoning request's growth), exact for token
  ids.
- **``max_tokens``** (or ``max_completion_tokens``) as sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meridian.config import ModelDefinition
from meridian.core.routing import NewRequest
from meridian.core.types import Phase

__all__ = ["CHARS_PER_TOKEN", "describe_request", "prompt_phase"]

# The directive that skips the think phase, for families that support it.
NO_THINK = "/no_think"
# A typical English BPE ratio (OpenAI's rule of thumb is about 4 characters a token).
CHARS_PER_TOKEN = 4
# chat_template_kwargs keys whose false value closes the think block in the prompt.
_THINKING_SWITCHES = ("enable_thinking", "thinking")


def prompt_phase(text: str, definition: ModelDefinition) -> Phase:
    """The phase a request whose prompt is ``text`` starts in (module docstring).

    >>> from meridian.config.boundaries import BUNDLED_MODELS
    >>> r1 = BUNDLED_MODELS["deepseek_r1"]
    >>> prompt_phase("Hi<｜Assistant｜><think>\\n", r1), prompt_phase("Hi</think>\\n\\n", r1)
    (<Phase.THINK: 1>, <Phase.OUTPUT: 2>)
    """
    start, end = definition.think_start, definition.think_end
    if definition.supports_think_disable and NO_THINK in text:
        return Phase.OUTPUT
    tail = text.rstrip("\n")  # the token rule passes over newline tokens after a marker
    if tail.endswith(start):
        return Phase.THINK
    if tail.endswith(end):
        return Phase.OUTPUT
    opened = text.rfind(start)
    if opened >= 0 and end not in text[opened:]:
        return Phase.THINK  # the reasoning started in the prompt
    return Phase.THINK if definition.think_starts_in_prompt else Phase.PREFILL


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = [_get(part, "text") for part in content]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def _get(obj: Any, name: str) -> Any:
    """``obj[name]`` of a dict, ``obj.name`` of anything else (``None`` when absent)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def describe_request(body: Any, definition: ModelDefinition) -> NewRequest:
    """The :class:`~meridian.core.routing.NewRequest` a chat or completion body stands for."""
    max_tokens = _get(body, "max_tokens") or _get(body, "max_completion_tokens")
    bound = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
    messages = _get(body, "messages")
    if messages is not None:
        texts = [_content_text(_get(m, "content")) for m in messages]
        num_prompt = max(1, sum(len(t) for t in texts) // CHARS_PER_TOKEN)
        switches = _get(body, "chat_template_kwargs") or {}
        closed = isinstance(switches, Mapping) and any(
            switches.get(key) is False for key in _THINKING_SWITCHES
        )
        if closed:
            return NewRequest(Phase.OUTPUT, num_prompt, bound)
        # The rendered prompt ends with the template's generation prompt.
        phase = Phase.THINK if definition.think_starts_in_prompt else Phase.PREFILL
        return NewRequest(phase, num_prompt, bound)
    prompt = _get(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        return NewRequest(
            prompt_phase(prompt, definition), max(1, len(prompt) // CHARS_PER_TOKEN), bound
        )
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return NewRequest(Phase.PREFILL, max(1, len(prompt)), bound)
    return NewRequest(Phase.PREFILL, 1, bound)
