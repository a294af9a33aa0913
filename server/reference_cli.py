"""`cadence-reference`: greedy generation with the reference generator, printed as one JSON object.

    cadence-reference --model=smollm2-135m --prompt="The capital of France is" --max_tokens=8
    {"prompt_ids": [...], "output_ids": [...], "text": " Paris. ..."}

`--max_tokens=0` only tokenizes. `--chat` wraps the prompt as one user message in the model's
chat template. This is the oracle for the engine's tests, not a serving path.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.registry import load_model
from cadence.engine.reference import greedy_generate
from cadence.server.flags import MODEL_FLAG as _MODEL
from cadence.server.runtime import chat_from_flags

_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.", required=True)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens to generate (0: tokenize only).", lower_bound=0)
_CHAT = flags.DEFINE_bool("chat", False, "Apply the model's chat template to the prompt.")


def main(argv: list[str]) -> int:
    del argv
    try:
        model = load_model(_MODEL.value)
        chat_from_flags(model)
        tok = model.tokenizer
        text = _PROMPT.value
        if _CHAT.value:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        prompt_ids = tok.encode(text)
        output_ids = greedy_generate(
            model.params, model.config, prompt_ids, _MAX_TOKENS.value, tok.eos_ids
        )
    except (CheckpointError, ValueError) as e:
        print(f"cadence-reference: error: {e}", file=sys.stderr)
        return 2
    result = {
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "text": tok.decode(output_ids, skip_special=True),
    }
    print(json.dumps(result, ensure_ascii=False))
    return 0


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
