"""``meridian bench accuracy``: what forcing costs in answer quality, on a labelled set, against
any OpenAI-compatible server (vLLM with or without Meridian, SGLang).

Each forcing policy is a set of request fields, so one server serves every policy:

=================  ==================================================================  =========
policy             request fields                                                      needs
=================  ==================================================================  =========
``none``           ``meridian_forcing: "off"``: the model reasons as long as it wants  Meridian
``cap:N``          vLLM's static ``thinking_token_budget: N``, Meridian's forcing off  vLLM
``hard-cap:N``     ``meridian_max_think_tokens: N``, ``meridian_signals: "none"``      Meridian
``meridian``       nothing: the server's ``[entropy]`` signals and its hard cap        Meridian
``eat``            ``meridian_signals: "eat"``: the EAT stream proxy (ADR-0007)        Meridian
``rpdi``           ``meridian_signals: "rpdi"``                                        Meridian
``eat-probe:N``    the paper's EAT, measured by the harness every N reasoning tokens   vLLM
                   (:mod:`meridian.bench.eat_probe`); ``meridian_forcing: "off"``
=================  ==================================================================  =========

``cap:N`` takes a comma list in one policy argument's place: ``cap:64,128,256`` is a sweep.
``eat-probe`` without N probes every ``[entropy].eat_probe_interval_tokens`` tokens (32), the
stream proxy's interval, so ``eat`` and ``eat-probe`` differ in their signal only; its tracker
takes the ``[entropy]`` section's ``ema_alpha``, ``eat_ema_variance_threshold`` and
``eat_min_distance``.
Stock vLLM passes ``vllm_xargs`` on to ``extra_args``, which nothing reads there: against a
server without Meridian only ``none`` and ``cap:N`` mean what they say (SGLang names its own
budget differently; ``cap:N`` is vLLM's field).

The dataset is JSON Lines, one item per line::

    {"prompt": "...", "answer": "42", "checker": "numeric", "tolerance": 0.5}

``checker`` (default ``exact``): ``exact`` (the answer text equals ``answer`` up to case, spaces
and a final full stop), ``numeric`` (the last number in the answer is within ``tolerance`` of
``answer``; commas in numbers are ignored), ``regex`` (``pattern``, else ``answer``, is found in
the answer text), ``choice`` (the last standalone capital letter of the answer text, among the
first ``len(choices)`` letters when ``choices`` is given, is ``answer``). Only the answer
(``content``) is graded; the reasoning never is.

Think tokens are the server's ``usage.completion_tokens_details.reasoning_tokens`` where it
counts them. vLLM 0.32's parsers count only tokens between a generated start and end marker, so
for models whose chat template puts ``<think>`` in the prompt (DeepSeek-R1's, the tiny test
model's) it reports 0 with reasoning text present; then the harness counts the output's token
ids (vLLM's ``return_token_ids``) before the first ``think_end`` (its ids from the server's
``/tokenize``), or all of them when the answer never started. Answer tokens are
``completion_tokens`` less the think tokens (the end marker included). Accuracy comes with a
95 % Wilson interval.
"""

from __future__ import annotations

from meridian.bench.accuracy.client import AccuracyRun, Outcome, count_think_tokens, run_accuracy
from meridian.bench.accuracy.dataset import CHECKERS, DatasetError, Item, grade, load_dataset
from meridian.bench.accuracy.policies import ForcingPolicy, parse_forcing_policies
from meridian.bench.accuracy.report import COLUMNS, cells, markdown, write_accuracy_report
from meridian.bench.accuracy.summary import (
    ForcingSummary,
    pareto_front,
    summarize,
    wilson_interval,
)

__all__ = [
    "CHECKERS",
    "COLUMNS",
    "AccuracyRun",
    "DatasetError",
    "ForcingPolicy",
    "ForcingSummary",
    "Item",
    "Outcome",
    "cells",
    "count_think_tokens",
    "grade",
    "load_dataset",
    "markdown",
    "pareto_front",
    "parse_forcing_policies",
    "run_accuracy",
    "summarize",
    "wilson_interval",
    "write_accuracy_report",
]
