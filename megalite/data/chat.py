"""Conversations as training tokens: a tokenizer's chat template rendered as transformers'
`apply_chat_template` renders it, and a mask of the tokens that are targets.

Rendering: jinja2's immutable sandbox with trim_blocks and lstrip_blocks, loop controls, a
`tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`; the variables
`messages`, `add_generation_prompt` and the tokenizer's special tokens (bos_token, eos_token,
...). The text is tokenized without added special tokens: the template writes them.

Targets (`train_on`): `assistant`, what the assistant says, as the template marks it with
`{% generation %}...{% endgeneration %}` (a token is a target if it overlaps a marked span, as
transformers' `return_assistant_tokens_mask`), or, for a template without the mark, each
assistant turn as the template renders it, found by rendering the conversation prefix by
prefix (from the end of the prompt before the turn to the end of the turn: its end-of-turn
token included); `last`: the last assistant turn only; `all`: every token.
"""
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megalite.data.tokenizer import TokenizerInfo
from megalite.typed_config import ConfigError

TRAIN_ON = ("assistant", "last", "all")
# Private-use characters around each {% generation %} block's output while rendering: they
# give the blocks' places in the text, and are removed after.
OPEN, CLOSE = "\ue000", "\ue001"


class ChatError(ValueError):
    """A conversation that cannot become training tokens (counted by prepare-data as a bad
    record, with this message)."""


class _Generation(Extension):
    """{% generation %} ... {% endgeneration %}: what the assistant says."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return OPEN + caller() + CLOSE


def _raise(message: str):
    raise ChatError(f"the chat template refused the conversation: {message}")


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict  # bos_token, eos_token, ... as the template sees them

    def render(self, messages: list[dict], add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the [start, end) character spans of its {% generation %} blocks."""
        if any(isinstance(value, str) and (OPEN in value or CLOSE in value)
               for message in messages for value in message.values()):
            raise ChatError("a message holds U+E000 or U+E001, which rendering reserves")
        try:
            marked = _compile(self.source).render(messages=messages, **self.special_tokens,
                                                  add_generation_prompt=add_generation_prompt)
        except ChatError:
            raise
        except Exception as err:  # jinja2's errors: a template that fails on this conversation
            raise ChatError(f"the chat template failed on the conversation: "
                            f"{type(err).__name__}: {err}") from err
        spans, start = [], None
        # A mark's place in the text: its place in `marked`, less the n marks before it.
        for n, mark in enumerate(re.finditer(f"[{OPEN}{CLOSE}]", marked)):
            if mark.group() == OPEN:
                start = mark.start() - n
            else:
                spans.append((start, mark.start() - n))
        return marked.replace(OPEN, "").replace(CLOSE, ""), spans

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text of the conversation and the spans of what the assistant says."""
        text, marked = self.render(messages)
        if re.search(r"\{%-?\s*generation\s*-?%\}", self.source):  # the template marks them
            return text, marked
        spans = []
        for i in [i for i, message in enumerate(messages) if message.get("role") == "assistant"]:
            prompt, _ = self.render(messages[:i], add_generation_prompt=True)
            through, _ = self.render(messages[:i + 1])
            if not (text.startswith(prompt) and text.startswith(through) and len(prompt) <= len(through)):
                raise ChatError("the chat template does not render the conversation prefix by "
                                "prefix, so its assistant turns cannot be found; mark them with "
                                "{% generation %}...{% endgeneration %}")
            spans.append((len(prompt), len(through)))
        return text, spans


def conversation_of(record: dict, prompt_only: bool = False) -> list[dict]:
    """The messages of a record: `messages` (a list of {role, content}, the chat shape), or a
    `prompt` and its `completion` (prompt_only: a prompt alone, to be answered)."""
    if not isinstance(record, dict):
        raise ChatError("the record is not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in messages):
            raise ChatError("'messages' is not a list of {role, content} objects")
        if not messages:  # else counted as whatever the template makes of nothing
            raise ChatError("'messages' is empty")
        return messages
    if "prompt" in record and ("completion" in record or prompt_only):
        answer = [{"role": "assistant", "content": record["completion"]}] if "completion" in record else []
        return [{"role": "user", "content": record["prompt"]}] + answer
    raise ChatError("the record has neither 'messages' nor 'prompt' and 'completion'")


def tokens_and_targets(template: ChatTemplate, tokenizer, messages: list[dict],
                       train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """The conversation's token ids (a tokenizers.Tokenizer, no special tokens added) and which
    of them are targets."""
    text, spans = template.assistant_spans(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    if train_on == "all":
        return encoding.ids, [True] * len(encoding.ids)
    if train_on == "last":
        spans = spans[-1:]
    targets, span = [], 0
    for start, end in encoding.offsets:  # both in order: one pass
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        targets.append(span < len(spans) and end > spans[span][0])
    if not any(targets):
        raise ChatError("the chat template renders no assistant tokens for this conversation")
    return encoding.ids, targets


def conversation_tokens(template: ChatTemplate, tokenizer: TokenizerInfo, messages: list[dict],
                        train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """A conversation as prepared data holds it: tokens_and_targets, then eos (a target only
    when train_on is all) where the template did not end it so, as a document ends."""
    tokens, targets = tokens_and_targets(template, tokenizer.tokenizer, messages, train_on)
    if not tokens or tokens[-1] != tokenizer.eos_id:
        tokens, targets = tokens + [tokenizer.eos_id], targets + [train_on == "all"]
    return tokens, targets


def generation_prompt(template: ChatTemplate, tokenizer: TokenizerInfo,
                      messages: list[dict]) -> tuple[str, list[int]]:
    """The conversation rendered up to the assistant's answer (the template's generation
    prompt): its text and ids, as training saw such text."""
    text, _ = template.render(messages, add_generation_prompt=True)
    return text, tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def load_chat_template(tokenizer: TokenizerInfo, given: str | None) -> ChatTemplate:
    """The template given (data.chat_template: the template itself, or a .jinja file), else the
    tokenizer's own."""
    source = given or tokenizer.chat_template
    if source is None:
        raise ConfigError(f"no chat template: the tokenizer's directory ({tokenizer.file.parent}) has "
                          f"neither chat_template.jinja nor a chat_template in tokenizer_config.json; "
                          f"give one with data.chat_template (the template, or a .jinja file)")
    if given and given.endswith(".jinja") and Path(given).is_file():
        source = Path(given).read_text()
    return ChatTemplate(source, tokenizer.names)
