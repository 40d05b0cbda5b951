"""Chat templates rendered as transformers renders them: a Llama-3-shaped and a Qwen-shaped
template (written here), multi-turn conversations with a system prompt, non-ASCII text and
`tojson`, give `apply_chat_template`'s tokens exactly, and the targets equal its
`return_assistant_tokens_mask`. Without {% generation %} marks, the assistant turns are found by
rendering prefix by prefix. No prompt token is ever a target."""
import pytest

from megalite.data.chat import ChatError, ChatTemplate, conversation_of, tokens_and_targets
from tests.support.chat import CONVERSATIONS, LLAMA3, TEMPLATES, TOKENS

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.unit


def hf(tokenizer, name: str):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **TOKENS[name])
    fast.chat_template = TEMPLATES[name]
    return fast


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_tokens_and_targets_are_transformers(tokenizer, name, conversation):
    messages = CONVERSATIONS[conversation]
    theirs = hf(tokenizer, name).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
    ids, targets = tokens_and_targets(ChatTemplate(TEMPLATES[name], TOKENS[name]), tokenizer, messages)
    assert ids == list(theirs["input_ids"])
    assert [int(t) for t in targets] == list(theirs["assistant_masks"])
    # What the targets say is what the assistant said, each turn with its end-of-turn token.
    eot = TOKENS[name]["eos_token"]
    said = "".join(m["content"].strip() if name == "llama3" else m["content"]
                   for m in messages if m["role"] == "assistant")
    assert tokenizer.decode([i for i, t in zip(ids, targets) if t], skip_special_tokens=False
                            ).replace(eot, "") == said


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_without_generation_marks_the_turns_are_found_prefix_by_prefix(tokenizer, name):
    source = TEMPLATES[name].replace("{% generation %}", "").replace("{% endgeneration %}", "")
    messages = CONVERSATIONS[1]
    ids, targets = tokens_and_targets(ChatTemplate(source, TOKENS[name]), tokenizer, messages)
    fast = hf(tokenizer, name)
    fast.chat_template = source
    assert ids == list(fast.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    # Each assistant turn as rendered: the content and the end-of-turn token, and the newline
    # Qwen's template writes after it (which its {% endgeneration %} had trimmed).
    eot = TOKENS[name]["eos_token"]
    turns = [(m["content"].strip() + eot) if name == "llama3" else (m["content"] + eot + "\n")
             for m in messages if m["role"] == "assistant"]
    assert tokenizer.decode([i for i, t in zip(ids, targets) if t], skip_special_tokens=False) == "".join(turns)


def test_train_on_last_and_all(tokenizer):
    template, messages = ChatTemplate(LLAMA3, TOKENS["llama3"]), CONVERSATIONS[1]
    ids, every = tokens_and_targets(template, tokenizer, messages, "assistant")
    _, last = tokens_and_targets(template, tokenizer, messages, "last")
    _, everything = tokens_and_targets(template, tokenizer, messages, "all")
    assert all(everything) and len(everything) == len(ids)
    first_last = last.index(True)
    assert not any(last[:first_last]) and sum(last) < sum(every)
    assert last[first_last:] == every[first_last:]


def test_bad_conversations_are_named(tokenizer):
    template = ChatTemplate(LLAMA3 + "{% if messages[-1]['role'] == 'tool' %}"
                            "{{ raise_exception('no tools') }}{% endif %}", TOKENS["llama3"])
    with pytest.raises(ChatError, match="no tools"):
        tokens_and_targets(template, tokenizer, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatError, match="no assistant tokens"):
        tokens_and_targets(template, tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatError, match="neither 'messages' nor 'prompt'"):
        conversation_of({"text": "plain"})
    with pytest.raises(ChatError, match="not a list"):
        conversation_of({"messages": [{"content": "no role"}]})
    assert conversation_of({"prompt": "Q", "completion": "A"}) == [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
