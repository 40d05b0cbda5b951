"""Bad records named where they are: a conversation by its line of the jsonl file (1-based) or
its row of the parquet file (0-based), in whichever chunk it is read, each with its own reason
(an empty `messages` list its own); the counts per reason at the end of `prepare-data` and in
the trainer's data line; conversations given as text refused by their shape."""
import json

import pytest

from megalite import cli
from megalite.prep import sources
from megalite.prep.command import prepare_for_run
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.run_config import DataConfig
from megalite.train import report_data
from megalite.typed_config import ConfigError
from tests.support.chat import CONVERSATIONS

GOOD = {"messages": CONVERSATIONS[0]}
BAD = [{"messages": []},
       {"messages": [{"role": "user", "content": "no answer"}]},
       {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}]
NO_ASSISTANT = "the chat template renders no assistant tokens for this conversation"
LISTED = ["line 42: 'messages' is empty", f"line 43: {NO_ASSISTANT}",
          "line 44: the chat template refused the conversation: no tools"]
REASONS = {"'messages' is empty": 1, NO_ASSISTANT: 1, "the chat template refused the conversation": 1}
SKIPPED = (f"3 records skipped: 1 'messages' is empty, 1 {NO_ASSISTANT}, 1 the chat template "
           f"refused the conversation")


def write_chat(path):
    """41 good conversations, the bad ones on lines 42-44, a good one after."""
    path.write_text("".join(json.dumps(r) + "\n" for r in [GOOD] * 41 + BAD + [GOOD]))
    return path


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [0, 2])
def test_bad_conversations_are_named_by_their_line(tmp_path, model_dir, monkeypatch, workers):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1000)  # about 6 lines a chunk: 42 is not a first
    chat = write_chat(tmp_path / "chat.jsonl")
    settings = PrepareSettings(tokenizer=str(model_dir), workers=workers, chat_template="auto",
                               progress=False)
    meta = prepare_directory([chat], tmp_path / "out", settings)
    (shard,) = meta["shards"]
    assert (shard["records"], shard["documents"], shard["no_text"]) == (45, 42, 3)
    assert shard["bad"] == LISTED
    assert shard["reasons"] == meta["reasons"] == REASONS
    with pytest.raises(ConfigError, match=r"chat\.jsonl:42: 'messages' is empty; fix or drop it"):
        prepare_directory([chat], tmp_path / "strict",
                          PrepareSettings(tokenizer=str(model_dir), chat_template="auto",
                                          strict=True, progress=False))


@pytest.mark.unit
def test_parquet_conversations_are_named_by_their_row(tmp_path, model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"messages": [CONVERSATIONS[0], CONVERSATIONS[0], [],
                                          [{"role": "user", "content": "no answer"}]]}),
                   tmp_path / "chat.parquet")
    meta = prepare_directory([tmp_path / "chat.parquet"], tmp_path / "out", PrepareSettings(
        tokenizer=str(model_dir), chat_template="auto", progress=False))
    assert meta["shards"][0]["bad"] == ["row 2: 'messages' is empty", f"row 3: {NO_ASSISTANT}"]
    assert meta["reasons"] == {"'messages' is empty": 1, NO_ASSISTANT: 1}


@pytest.mark.unit
def test_the_counts_per_reason_end_prepare_data_and_start_training(tmp_path, model_dir, capsys):
    out = tmp_path / "out"
    assert cli.main(["prepare-data", "--input", str(write_chat(tmp_path / "chat.jsonl")), "--out",
                     str(out), "--tokenizer", str(model_dir), "--chat-template", "auto",
                     "--workers", "0"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["reasons"] == REASONS
    assert captured.err.splitlines()[-1] == \
        f"prepare-data: {SKIPPED} (the first 20 of each file listed by line in {out}/meta.json)"
    data = prepare_for_run(DataConfig(path=str(out), val_fraction=0, cache_dir=str(tmp_path / "cache")))
    report_data(data)
    tokens = data.meta["train_tokens"]
    assert capsys.readouterr().out == (
        f"data: 42 training documents ({tokens} tokens), 0 validation documents (0 tokens); "
        f"{SKIPPED} (the first 20 of each file listed by line in the prepared data's meta.json)\n")


@pytest.mark.unit
def test_conversations_without_a_chat_template_are_recognised(tmp_path, model_dir, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n" + json.dumps(GOOD) + "\n" + json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    pq.write_table(pa.table({"prompt": ["Q"], "completion": ["A"]}), tmp_path / "pairs.parquet")
    for path, shape, given in ((chat, "'messages'", []),
                                   (tmp_path / "pairs.parquet", "'prompt' and 'completion'",
                                    ["--tokenizer", str(model_dir)])):
        assert cli.main(["prepare-data", "--input", str(path), "--out", str(tmp_path / "out"),
                         "--workers", "0", *given]) == 2
        assert capsys.readouterr().err == (
            f"megalite: error: '{path}': these are conversations ({shape}, no text field 'text'): "
            f"add --chat-template auto (data.chat_template=auto) to render them with the "
            f"--tokenizer's chat template\n")


@pytest.mark.unit
def test_text_given_as_conversations_is_refused_as_such(tmp_path, model_dir):
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(ConfigError) as refused:
        prepare_directory([tmp_path / "docs.jsonl"], tmp_path / "out", PrepareSettings(
            tokenizer=str(model_dir), chat_template="auto", progress=False))
    assert str(refused.value) == (
        f"'{tmp_path / 'docs.jsonl'}': none of its 2 records gives a conversation to train on "
        f"(line 1: the record has neither 'messages' nor 'prompt' and 'completion'): give records "
        f"of `messages`, or `prompt` and `completion`, that the chat template renders with "
        f"assistant tokens, or leave out --chat-template (data.chat_template) for text")
