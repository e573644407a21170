"""The kinds of request the engine serves, declared once (torch-free). A request's parameters name its kind:
SamplingParams a generation, PoolingParams an embedding. The input processor, the scheduler, the model runner
and the engine's after-step update ask the kind; none of them tests for a particular one.

A kind that does not sample runs its prompt through the model like any prefill (chunked, batched with the
rest, over the paged KV cache, preemptible); where a generation would sample, the runner's reader for the
kind (``worker/request_kinds.py``) makes one result from the final hidden states, and the request is
finished with it. Adding such a kind: its declaration here, its reader there, its field on RequestOutput.

Scoring (prompt logprobs, or echo with max_tokens 0) is not a kind: it is a generation's parameter, and the
request samples and streams like any other."""

from collections.abc import Callable
from dataclasses import dataclass

from pagoda.errors import InvalidParam
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

RequestParams = SamplingParams | PoolingParams


@dataclass(frozen=True)
class RequestKind:
    name: str
    params_type: type  # a request whose parameters are of this type is of this kind
    # True: draws tokens from its logits each step until a stop (may fork, draft, stream); False: makes one
    # result at the end of its prompt, from the final hidden states, and is finished with it
    samples: bool
    # whether every prompt position must be computed, none taken from the prefix cache: a cached prefix has
    # neither logits (a generation scoring its prompt) nor hidden states (mean pooling)
    reads_every_prompt_token: Callable[[RequestParams], bool]
    output_field: str | None = None  # the RequestOutput field a non-sampling kind's result fills

    def owns(self, params) -> bool:
        return isinstance(params, self.params_type)

    def sampling_params(self, params: RequestParams) -> SamplingParams:
        """What the sequence is scheduled and stop-checked with: a generation's own parameters; for a kind
        that does not sample, one greedy token that is never drawn (its prompt's end is its only step that
        would sample)."""
        return params if self.samples else SamplingParams(max_tokens=1, temperature=0.0)

    def __reduce__(self):  # pickled by name: the declarations hold functions
        return kind_named, (self.name,)


GENERATE = RequestKind("generate", SamplingParams, samples=True,
                       reads_every_prompt_token=lambda params: params.prompt_logprobs is not None)
EMBED = RequestKind("embed", PoolingParams, samples=False,
                    reads_every_prompt_token=lambda params: params.needs_every_token, output_field="embedding")
KINDS = (GENERATE, EMBED)


def kind_of(params) -> RequestKind:
    for kind in KINDS:
        if kind.owns(params):
            return kind
    names = " or ".join(k.params_type.__name__ for k in KINDS)
    raise InvalidParam("sampling_params", f"expected {names}, got {type(params).__name__}")


def kind_named(name: str) -> RequestKind:
    return next(kind for kind in KINDS if kind.name == name)
