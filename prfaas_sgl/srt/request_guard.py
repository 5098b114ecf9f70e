"""Refuse, inside every SGLang server, request values that would crash its scheduler instead of failing the request.

SGLang 0.5.23 checks a prompt's length but not its token ids (`maybe_detect_oob` is off unless
`SGLANG_ENABLE_ASYNC_ASSERT` is set): an id past the vocabulary reaches the embedding gather in the scheduler
process, which raises `IndexError` on CPU (a device-side assert on CUDA) and takes the whole server down. The
router refuses such ids too, but a client that talks to a server directly must not be able to crash it either.

The checks hook `TokenizerManager._validate_one_request`, which runs in the HTTP process for every generate and
embedding request after tokenization; a `ValueError` there is SGLang's own "400 Bad Request" path. The rules
themselves are plain Python (`prompt_problem`, `sampling_problem`) so fast tests run them without SGLang.
"""
from __future__ import annotations

from typing import Any

VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
CHAT_VALIDATE = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request"
FAN_OUT = "sglang.srt.managers.io_struct.GenerateReqInput._handle_parallel_sampling"

# Sequences one request may fan out to (batch size x `n`): SGLang queues them all at once, and `n` = 10**6 on one
# prompt grew a CPU server past 14 GiB until the kernel killed it. OpenAI caps `n` at 128.
MAX_N = 128
MAX_SEQUENCES = 1024


def prompt_problem(ids: Any, vocab_size: int) -> str | None:
    """Why ``ids`` cannot be a prompt for an embedding of ``vocab_size`` rows, or None when it can."""
    if not isinstance(ids, list):
        return f"input_ids must be a list of token ids, got {type(ids).__name__}"
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"input_ids[{i}] must be an integer token id, got {t!r:.40}"
        if not 0 <= t < vocab_size:
            return f"input_ids[{i}] = {t} is not a token id of this model (valid: 0 <= id < {vocab_size})"
    return None


def _ints(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def sampling_problem(params: dict[str, Any], vocab_size: int) -> str | None:
    """Why these sampling parameters would fail in the scheduler rather than in SamplingParams.verify, or None.

    Stop ids index vocabulary-sized tensors in the scheduler (the min-new-tokens penalizer scatters them), where
    an id past the vocabulary raises like a prompt id does."""
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        for t in _ints(stop_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                return f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r:.40}"
    return None


def logprob_problem(top_num: Any, start_len: Any, vocab_size: int) -> str | None:
    """Why these log-probability fields would fail in the scheduler, or None: ``top_logprobs_num`` is the k of a
    top-k over the vocabulary (k = 10**6 raised "selected index k out of range" in the sampler and took the
    server down); ``logprob_start_len`` -1 means "from the end of the prompt"."""
    for t in _ints(top_num):
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= vocab_size):
            return f"top_logprobs_num must be an integer in [0, {vocab_size}], got {t!r:.40}"
    for s in _ints(start_len):
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < -1):
            return f"logprob_start_len must be an integer >= -1, got {s!r:.40}"
    return None


# Parameters of transformers' `apply_chat_template` that SGLang passes itself: the same name in a request's
# `chat_template_kwargs` raised TypeError/KeyError in the handler (a 500). `chat_template` SGLang checks itself.
TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def template_kwargs_problem(kwargs: Any) -> str | None:
    if not kwargs:
        return None
    if not isinstance(kwargs, dict):
        return "chat_template_kwargs must be an object"
    clash = sorted(TEMPLATE_CALL_ARGS & kwargs.keys())
    return f"chat_template_kwargs may not set {clash}: the server sets them" if clash else None


def fan_out_problem(batch_size: int, n: Any) -> str | None:
    """Why a request of ``batch_size`` prompts, each sampled ``n`` times, is too large, or None."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        return f"n must be an integer in [1, {MAX_N}], got {n!r:.40}"
    if batch_size * n > MAX_SEQUENCES:
        return f"{batch_size} prompts x n={n} is more than {MAX_SEQUENCES} sequences in one request"
    return None


def check(obj: Any, input_ids: Any, vocab_size: int) -> None:
    """Raise ValueError (SGLang's 400 path) naming the first problem of this request."""
    problem = None
    if input_ids is not None:
        problem = prompt_problem(input_ids, vocab_size)
    params = getattr(obj, "sampling_params", None)
    if problem is None and isinstance(params, dict):
        problem = sampling_problem(params, vocab_size)
    if problem is None:
        problem = logprob_problem(getattr(obj, "top_logprobs_num", None), getattr(obj, "logprob_start_len", None),
                                  vocab_size)
    if problem is not None:
        raise ValueError(problem)


def before_validate(self, obj, input_ids, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request: refuse what would crash the scheduler."""
    check(obj, input_ids, self.model_config.vocab_size)
    return None


def after_fan_out(result, self, *args, **kwargs):
    """AFTER hook on GenerateReqInput._handle_parallel_sampling (batch size and `n` are known, nothing is queued)."""
    problem = fan_out_problem(self.batch_size, self.parallel_sample_num)
    if problem is not None:
        raise ValueError(problem)
    return result


def after_chat_validate(result, self, request, *args, **kwargs):
    """AFTER hook on OpenAIServingChat._validate_request (a returned message is SGLang's 400)."""
    return result or template_kwargs_problem(getattr(request, "chat_template_kwargs", None))


def install(HookRegistry, HookType) -> None:
    HookRegistry.register(CHAT_VALIDATE, after_chat_validate, HookType.AFTER)
    HookRegistry.register(VALIDATE, before_validate, HookType.BEFORE)
    HookRegistry.register(FAN_OUT, after_fan_out, HookType.AFTER)
