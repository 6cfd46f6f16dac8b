"""What Meridian's router reads of an OpenAI request before it is placed (no Ray, no vLLM).

Ray Serve hands the router the request as the ingress received it: a chat or completion body,
not tokens. The router needs its kind and size (:class:`~meridian.core.routing.NewRequest`):

- **The kind**: the phase router's rules (:meth:`~meridian.core.format.ReasoningFormat.
  initial_phase`) applied to the prompt's text, cut into the family's markers, newlines and the
  rest (:func:`prompt_phase`). A chat request's rendered prompt ends with the template's
  generation prompt, so the family's own default decides, unless ``chat_template_kwargs`` with
  ``enable_thinking`` (Qwen3) or ``thinking`` (DeepSeek-V3.1) false closes the block (it
  answers). A completion whose prompt is token ids is undecided (``PREFILL``).
- **The prompt length**, estimated at :data:`CHARS_PER_TOKEN` characters a token (the router has
  no tokenizer; the prompt weighs little beside a reasoning request's growth), exact for token
  ids.
- **``max_tokens``** (or ``max_completion_tokens``) as sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from meridian.config import ModelDefinition
from meridian.config.boundaries import BoundaryIds
from meridian.core.format import ReasoningFormat
from meridian.core.routing import NewRequest
from meridian.core.types import Phase

__all__ = ["CHARS_PER_TOKEN", "describe_request", "prompt_phase"]

# The directive that skips the think phase, for families that support it.
NO_THINK = "/no_think"
# A typical English BPE ratio (OpenAI's rule of thumb is about 4 characters a token).
CHARS_PER_TOKEN = 4
# The ids of a prompt's pieces (prompt_phase).
_START, _END, _NO_THINK, _NEWLINE, _OTHER = range(1, 6)
# chat_template_kwargs keys whose false value closes the think block in the prompt.
_THINKING_SWITCHES = ("enable_thinking", "thinking")
# prompt_phase's cut, piece ids and rules per family (markers, no_think, opened by the template).
_PIECE_RULES: dict[
    tuple[str, str, bool, bool], tuple[re.Pattern[str], dict[str, int], ReasoningFormat]
] = {}


def prompt_phase(text: str, definition: ModelDefinition) -> Phase:
    """The phase a request whose prompt is ``text`` starts in: core's rules
    (:meth:`ReasoningFormat.initial_phase`) on the text as pieces, one id each for the family's
    markers, ``/no_think``, a newline and any other run of text.

    >>> from meridian.config.boundaries import BUNDLED_MODELS
    >>> r1 = BUNDLED_MODELS["deepseek_r1"]
    >>> prompt_phase("Hi<｜Assistant｜><think>\\n", r1), prompt_phase("Hi</think>\\n\\n", r1)
    (<Phase.THINK: 1>, <Phase.OUTPUT: 2>)
    """
    start, end = definition.think_start, definition.think_end
    key = (start, end, definition.supports_think_disable, definition.think_starts_in_prompt)
    built = _PIECE_RULES.get(key)
    if built is None:  # once per family: the router asks per request
        markers = {start: _START, end: _END, NO_THINK: _NO_THINK, "\n": _NEWLINE}
        cut = "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True))
        rules = ReasoningFormat.from_boundaries(
            definition, BoundaryIds((_START,), (_END,), frozenset({_NEWLINE})), (_NO_THINK,)
        )
        built = _PIECE_RULES[key] = (re.compile(f"({cut})"), markers, rules)
    cut_re, ids_of, rules = built
    pieces = cut_re.split(text)  # odd indices: the markers
    return rules.initial_phase([ids_of[p] if i % 2 else _OTHER for i, p in enumerate(pieces) if p])


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
        # The rendered prompt ends with the template's generation prompt: the family decides.
        return NewRequest(prompt_phase("", definition), num_prompt, bound)
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
