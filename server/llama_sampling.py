"""llama.cpp's samplers as llama-server reads them from a request, on every door that takes them.

    params, breakers = llama_sampling.with_samplers(body, params)  # llama.cpp's order and samplers
    ids = DryBreakers(tokenizer).ids(breakers)                     # DRY's breakers, as token ids

llama-server samples every request, on its own endpoints and on its OpenAI-compatible ones
alike, through one chain in llama.cpp's order: the penalties, DRY, top-n-sigma, top-k, typical,
top-p, min-p, XTC, and the temperature last (`LLAMA_ORDER`). cadence's OpenAI doors sample in
vLLM's order (the temperature first) unless a request names one of llama.cpp's own samplers
(`FIELDS`): then it is sampled as llama-server would sample it (`with_samplers`,
`RequestSampling.temperature_last`). llama-server's /completion and /infill always are.

The samplers cadence runs: DRY (`dry_*`, its breakers the served vocabulary's tokens that hold
a breaking character, `DryBreakers`), `top_n_sigma`, `typical_p`, XTC (`xtc_probability`,
`xtc_threshold`) and the dynamic temperature (`dynatemp_range`, `dynatemp_exponent`), each off
at llama-server's default; `samplers` names those that run, in the default order (one left out
is off; another order is a 400). `adaptive_p` named last in `samplers` makes the draw
llama.cpp's adaptive-p at `adaptive_target` (negative: off) and `adaptive_decay`, as in
llama-server, where the default chain leaves it out. `mirostat` 1 or 2 (with `mirostat_tau`,
`mirostat_eta`) replaces the chain, as in llama-server: logit_bias, the temperature, then
Mirostat, every other sampler and the penalties off (`MIROSTAT_OFF`). Those it does not run
(tail-free, min_keep) are accepted where they are off, as clients that send every setting send
them, with the settings that mean nothing while they are (`OFF`); turned on, each is a 400
naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.model.host_sampling import MAX_ADAPTIVE_DECAY, MAX_DRY_BREAKERS, MAX_PENALTY_WINDOW
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.request import GenerationParams
from cadence.server import parsing

Off = tuple[tuple[type, ...], Callable[[Any], bool], str]
# llama.cpp's samplers that cadence does not run, with the test that a value leaves one off and
# that value in words (tfs_z and penalize_nl are older llama-servers', which clients still send).
OFF: dict[str, Off] = {
    "tfs_z": ((int, float), lambda v: v >= 1, "1"),
    "min_keep": ((int,), lambda v: v <= 1, "0"),  # (every sampler keeps one token anyway)
    "penalize_nl": ((bool,), lambda v: not v, "false"),
}
# Mirostat's and adaptive-p's fields and llama-server's defaults (`_stateful`).
MIROSTAT_FIELDS = {"mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1}
ADAPTIVE_FIELDS = {"adaptive_target": -1.0, "adaptive_decay": 0.9}
# DRY's fields (`_dry`) and defaults, llama-server's.
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
DRY_BASE, DRY_BREAKERS = 1.75, ("\n", ":", '"', "*")
# llama.cpp's samplers that cadence runs, with llama-server's defaults (`with_samplers`).
SAMPLER_FIELDS = {"typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
                  "dynatemp_range": 0.0, "dynatemp_exponent": 1.0}
# Every field of llama.cpp's sampling that cadence's other fields do not spell: naming one asks
# for llama.cpp's order. (Its penalties' names, `parsing.LLAMA_PENALTY_FIELDS`, ask for its
# penalties' window alone.)
FIELDS = frozenset({*SAMPLER_FIELDS, *DRY_FIELDS, *MIROSTAT_FIELDS, *ADAPTIVE_FIELDS, "samplers", *OFF})
# llama.cpp's default sampler chain, the order cadence applies them in (`samplers` may leave
# some out; typical_p is typ_p's other name), and what leaving each out turns off.
ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
# adaptive-p, not in the default chain, draws after all of them where `samplers` names it.
SAMPLERS = frozenset({*ORDER, "typical_p", "infill", "adaptive_p"})
_LEFT_OUT = {"penalties": {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
             "dry": {"dry_multiplier": 0.0}, "top_n_sigma": {"top_n_sigma": 0.0}, "top_k": {"top_k": 0},
             "typ_p": {"typical_p": 1.0}, "top_p": {"top_p": 1.0}, "min_p": {"min_p": 0.0},
             "xtc": {"xtc_probability": 0.0},
             # without its temperature sampler llama.cpp draws from the distribution as it is
             "temperature": {"temperature": 1.0, "dynatemp_range": 0.0}}
# On Mirostat, llama-server's chain is logit_bias, the temperature and Mirostat: the rest off.
MIROSTAT_OFF = {field: value for sampler in ORDER if sampler != "temperature"
                for field, value in _LEFT_OUT[sampler].items()} | {"dynatemp_range": 0.0}


def names(body: dict, name: str, allowed: frozenset[str] | None = None) -> tuple[str, ...]:
    """`body[name]` as an array of names (of `allowed`, where given), or SubmissionError."""
    values = parsing.field(body, name, (list,), [])
    if not all(isinstance(v, str) and (allowed is None or v in allowed) for v in values):
        known = f" of {', '.join(sorted(allowed))}" if allowed else ""
        raise SubmissionError(f'"{name}" must be an array of names{known}', name)
    return tuple(values)


def check_off(body: dict, off: Mapping[str, Off]) -> None:
    """What cadence does not do, accepted only where a request leaves it off (`off`); else
    SubmissionError. (Fields that change nothing: `llama_fields.check_ignored`.)"""
    for name, (types, is_off, words) in off.items():
        value = parsing.field(body, name, types)
        if value is not None and not is_off(value):
            raise SubmissionError(f'"{name}" is not supported by cadence; only {words} (off) is '
                                  f"accepted, got {json.dumps(value)[:40]}", name)


def names_any(body: dict) -> bool:
    """Whether a request names one of llama.cpp's own sampling fields (`FIELDS`)."""
    return any(body.get(name) is not None for name in FIELDS)


def with_samplers(body: dict, params: GenerationParams) -> tuple[GenerationParams, tuple[str, ...]]:
    """`params` in llama.cpp's order (`RequestSampling.temperature_last`), with its samplers as
    llama-server reads them: typical_p (1 or more: off), top_n_sigma (0 or less: off),
    xtc_probability with xtc_threshold (above 0.5: off), dynatemp_range (0 or less: off) with
    dynatemp_exponent, and DRY (`_dry`; its breakers returned beside, as text). `samplers`,
    where given, names those that run, in llama.cpp's default order (`ORDER`, which cadence
    keeps): one left out is off; `adaptive_p` last makes the draw adaptive-p's. `mirostat` on
    turns every other sampler off (`MIROSTAT_OFF`). Those cadence does not run must be off
    (`OFF`)."""
    check_off(body, OFF)
    values = {name: float(parsing.field(body, name, (int, float), default))
              for name, default in SAMPLER_FIELDS.items()}
    values["typical_p"] = min(values["typical_p"], 1.0)
    values["top_n_sigma"] = max(values["top_n_sigma"], 0.0)
    values["dynatemp_range"] = max(values["dynatemp_range"], 0.0)
    dry, breakers = _dry(body)
    values.update(dry)
    values.update(_stateful(body))
    named = names(body, "samplers", SAMPLERS)
    chain = [{"typical_p": "typ_p"}.get(n, n) for n in named if n != "infill"]
    if "adaptive_p" not in chain or values["mirostat"]:  # (off unless named, as in llama-server)
        values["adaptive_target"] = -1.0
    given = dict(values)  # (range-checked whether its sampler runs or is left out)
    if values["mirostat"]:
        values.update(MIROSTAT_OFF)
    elif body.get("samplers") is not None:
        at = [(*ORDER, "adaptive_p").index(n) for n in chain]
        if at != sorted(set(at)):
            raise SubmissionError(f'"samplers" runs in llama.cpp\'s default order here, each once: '
                                  f'{", ".join(ORDER)} (any of them left out), then adaptive_p; got '
                                  f'{", ".join(named)}', "samplers")
        for name in ORDER:
            if name not in chain:
                values.update(_LEFT_OUT[name])
    try:
        dataclasses.replace(params.sampling, **given)
        sampling = dataclasses.replace(params.sampling, **values, temperature_last=True)
    except ValueError as e:  # RequestSampling's range checks, each naming its field
        name = max((k for k in values if str(e).startswith(k)), key=len, default=None)
        raise SubmissionError(str(e), {"dry_window": "dry_penalty_last_n"}.get(name, name)) from None
    return dataclasses.replace(params, sampling=sampling), breakers


def _stateful(body: dict) -> dict[str, Any]:
    """Mirostat's and adaptive-p's settings with llama-server's defaults: `mirostat` 0 (off),
    1 or 2 (another version is a 400, where llama-server aborts), `mirostat_tau`,
    `mirostat_eta`; `adaptive_target` (above 1 is 1, as llama.cpp clamps it) and
    `adaptive_decay` (clamped to [0, 0.99], as there)."""
    version = parsing.field(body, "mirostat", (int,), 0)
    if version not in (0, 1, 2):
        raise SubmissionError(f'"mirostat" must be 0 (off), 1 or 2, got {version}', "mirostat")
    values = {name: float(parsing.field(body, name, (int, float), default))
              for name, default in {**MIROSTAT_FIELDS, **ADAPTIVE_FIELDS}.items() if name != "mirostat"}
    values["adaptive_target"] = min(values["adaptive_target"], 1.0)
    values["adaptive_decay"] = min(max(values["adaptive_decay"], 0.0), MAX_ADAPTIVE_DECAY)
    return {"mirostat": version, **values}


def _dry(body: dict) -> tuple[dict[str, Any], tuple[str, ...]]:
    """llama.cpp's DRY settings as llama-server reads them (its defaults; a dry_base below 1 is
    its default too; dry_penalty_last_n -1: the whole sequence, 0: off), checked, and its
    breakers as text (their token ids come from the served vocabulary, `DryBreakers`)."""
    multiplier = float(parsing.field(body, "dry_multiplier", (int, float), 0.0))
    base = float(parsing.field(body, "dry_base", (int, float), DRY_BASE))
    allowed = parsing.field(body, "dry_allowed_length", (int,), 2)
    window = parsing.field(body, "dry_penalty_last_n", (int,), 64)
    breakers = parsing.field(body, "dry_sequence_breakers", (list,), list(DRY_BREAKERS))
    if window < -1:
        raise SubmissionError('"dry_penalty_last_n" must be -1 (the whole sequence), 0 (off) or a number '
                              f"of tokens, got {window}", "dry_penalty_last_n")
    if not breakers or not all(isinstance(b, str) and len(b) == 1 for b in breakers):
        raise SubmissionError('"dry_sequence_breakers" must be a non-empty array of one-character strings '
                              "(cadence's DRY breaks on single tokens)", "dry_sequence_breakers")
    return ({"dry_multiplier": multiplier if window else 0.0, "dry_base": base if base >= 1 else DRY_BASE,
             "dry_allowed_length": allowed, "dry_window": MAX_PENALTY_WINDOW if window == -1 else window},
            tuple(dict.fromkeys(breakers)))


class DryBreakers:
    """DRY's breakers as token ids of one vocabulary: every token whose text holds one of the
    breaking characters (llama.cpp's single-token restart sequences). Each set is worked out
    once (the vocabulary's texts once, ~0.1 s for 49k tokens: off the event loop)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer, self._texts = tokenizer, None
        self._ids: dict[tuple[str, ...], tuple[int, ...]] = {}

    def ids(self, breakers: tuple[str, ...]) -> tuple[int, ...]:
        if breakers not in self._ids:
            if self._texts is None:
                self._texts = [self._tokenizer.decode([i]) for i in range(self._tokenizer.vocab_size)]
            ids = tuple(i for i, text in enumerate(self._texts) if any(b in text for b in breakers))
            if len(ids) > MAX_DRY_BREAKERS:
                raise SubmissionError(f'"dry_sequence_breakers" are in {len(ids)} of the vocabulary\'s '
                                      f"tokens; cadence holds at most {MAX_DRY_BREAKERS}", "dry_sequence_breakers")
            self._ids[breakers] = ids
        return self._ids[breakers]
