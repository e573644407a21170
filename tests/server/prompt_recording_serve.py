"""`pagoda serve` that appends the prompt token ids each door hands the engine (one JSON list a line) to the
file $TEST_SERVE_PROMPT_LOG: what a test compares `/tokenize` with."""

import json
import os
import sys

from pagoda.entrypoints.cli import main
from pagoda.entrypoints.openai.serving_base import OpenAIServing

_generate = OpenAIServing.generate


def generate(self, prompt, *args, **kwargs):
    with open(os.environ["TEST_SERVE_PROMPT_LOG"], "a") as log:
        log.write(json.dumps(prompt["prompt_token_ids"]) + "\n")
    return _generate(self, prompt, *args, **kwargs)


OpenAIServing.generate = generate

if __name__ == "__main__":
    sys.exit(main())
