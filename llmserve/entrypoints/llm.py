"""``LLM``: offline generation in one process, shaped like vLLM's ``LLM`` (prompts in,
``RequestOutput``s out), over an ``LLMEngine`` it builds from keyword arguments."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm import tqdm

from llmserve.config import EngineConfig
from llmserve.core.beam_search import BeamSearchParams
from llmserve.core.lora_request import LoRARequest
from llmserve.core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    beam_sampling_params,
)
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output import BeamSearchOutput, BeamSearchSequence, RequestOutput


class LLM:
    """Offline generation, shaped like vLLM's ``LLM``."""

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """``lora_request``: the adapter every prompt runs under, or one per prompt
        (None: the base model; needs ``enable_lora=True``)."""
        prompts = _as_prompt_list(prompts)
        params = _one_per_prompt(sampling_params, len(prompts), "SamplingParams")
        params = [sp or SamplingParams() for sp in params]
        loras = _one_per_prompt(lora_request, len(prompts), "LoRARequest")
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.check_lora(lora)  # a bad adapter fails here, nothing queued
        ids = [self.engine.add_request(p, final_only(sp), lora_request=lora).request_id
               for p, sp, lora in zip(prompts, params, loras)]
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text or token ids), vLLM's shape: one output
        per prompt, its ``sequences`` best first."""
        prompts = _as_prompt_list(prompts)
        sampling = beam_sampling_params(params)
        ids = [self.engine.add_request(p, final_only(sampling)).request_id for p in prompts]
        outputs = []
        for out in self._run(ids, use_tqdm):
            ids = out.prompt_token_ids
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(ids + c.token_ids,
                                   self.tokenizer.decode(ids + c.token_ids,
                                                         skip_special_tokens=True),
                                   c.cum_logprob, c.finish_reason, len(ids))
                for c in out.outputs]))
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.encode(render_chat(self.tokenizer, c),
                                                add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in request_ids]


def final_only(params: SamplingParams) -> SamplingParams:
    """A copy the engine may fill in, asking for one output per request, at its end."""
    params = params.copy()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def render_chat(tokenizer, messages: list[dict], **template_args) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **template_args)


def _one_per_prompt(value, count: int, what: str) -> list:
    """``value`` for every prompt, or its items when it is a sequence of one per prompt."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"need one {what} per prompt ({count}), got {len(value)}")
    return list(value)


PROMPT_FORMS = ("a string, a list of token ids, {'prompt': str} or "
                "{'prompt_token_ids': [int, ...]}, or a list of these")


def _as_prompt_list(prompts) -> list[str | list[int]]:
    """vLLM's prompt forms (TextPrompt / TokensPrompt dicts included) as strings or
    token-id lists; anything else is a ValueError that says what is accepted."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be {PROMPT_FORMS}; got {type(prompts).__name__}") from None
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return [_one_prompt(p) for p in prompts]


def _one_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return _one_prompt(list(prompt["prompt_token_ids"]))
        raise ValueError(f"a prompt dict must be {{'prompt': str}} or "
                         f"{{'prompt_token_ids': [int, ...]}}; got keys {sorted(keys)}")
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError(f"each prompt must be {PROMPT_FORMS}; got {prompt!r:.80}")
