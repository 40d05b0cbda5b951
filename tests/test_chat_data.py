"""prepare-data on conversations: jsonl records of `messages` and of `prompt` / `completion`,
rendered with the tokenizer directory's chat template, stored with a `.targets` side file; the
labels of the prepared rows are exactly what the assistant said (each turn with its end-of-turn
token), in one process and with worker processes; a record without a conversation, and one the
template refuses, are counted with their reasons; documents keep their shards' records."""
import json

import pytest

from megalite.data.batches import Samples
from megalite.data.chat import ChatTemplate, tokens_and_targets
from megalite.data.docs import DocSet, TokenStore
from megalite.data.indexed import IndexedShard, targets_path
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.parallel.vocab import IGNORE_INDEX
from megalite.typed_config import ConfigError
from tests.support.chat import CONVERSATIONS, QWEN, REFUSING

RECORDS = [{"messages": CONVERSATIONS[0]}, {"text": "a document, not a conversation"},
           {"prompt": "Say hi.", "completion": "Hi!"},
           {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
           {"messages": CONVERSATIONS[1]}]


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [0, 2])
def test_conversations_are_prepared_with_their_targets(tmp_path, model_dir, tokenizer, workers):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "prepared"
    meta = prepare_directory([data], out, PrepareSettings(
        tokenizer=str(model_dir), workers=workers, chat_template="auto", progress=False))
    assert meta["records"] == 5 and meta["documents"] == 3 and meta["no_text"] == 2
    shard = meta["shards"][0]
    assert any("neither 'messages'" in b for b in shard["bad"])
    assert any("no tools" in b for b in shard["bad"])
    assert shard["train_on"] == "assistant" and (out / "chat_template.jinja").read_text() == REFUSING
    assert targets_path(out / shard["name"]).is_file()
    samples = Samples(DocSet.whole(TokenStore([IndexedShard(out / shard["name"])])), "padded",
                      seq_len=256, pad_id=0)
    batch = samples.collate(range(3))
    said = [[m["content"] for m in c if m["role"] == "assistant"]
            for c in (CONVERSATIONS[0], [{"role": "assistant", "content": "Hi!"}], CONVERSATIONS[1])]
    for labels, turns in zip(batch.labels, said):
        targets = labels[labels != IGNORE_INDEX].tolist()
        assert tokenizer.decode(targets, skip_special_tokens=False) == "".join(
            t + "<|im_end|>" for t in turns)


@pytest.mark.unit
def test_documents_keep_their_shard_records(tmp_path, model_dir):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "plain text"}) + "\n")
    meta = prepare_directory([data], tmp_path / "out", PrepareSettings(
        tokenizer=str(model_dir), progress=False))
    assert "train_on" not in meta["shards"][0] and "chat_template_sha256" not in meta["shards"][0]
    assert not targets_path(tmp_path / "out" / meta["shards"][0]["name"]).exists()


@pytest.mark.unit
def test_conversations_need_jsonl_and_a_tokenizer(tmp_path, model_dir):
    text = tmp_path / "chat.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="conversations are read from jsonl"):
        prepare_directory([text], tmp_path / "a", PrepareSettings(
            tokenizer=str(model_dir), chat_template="auto", progress=False))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(ConfigError, match="need the model's tokenizer"):
        prepare_directory([data], tmp_path / "b", PrepareSettings(chat_template="auto", progress=False))


@pytest.mark.unit
def test_parquet_conversations(tmp_path, model_dir, tokenizer):
    """A parquet file of a `messages` column (a list of structs, as datasets writes them), and
    one of `prompt` and `completion` columns, give the jsonl records' targets; a null row is
    counted; a file with neither is refused naming its columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"messages": [CONVERSATIONS[0], None, CONVERSATIONS[1]]}),
                   tmp_path / "messages.parquet")
    pq.write_table(pa.table({"prompt": ["Say hi."], "completion": ["Hi!"]}), tmp_path / "pairs.parquet")
    meta = prepare_directory([tmp_path / "messages.parquet", tmp_path / "pairs.parquet"],
                             tmp_path / "out", PrepareSettings(tokenizer=str(model_dir),
                                                               chat_template="auto", progress=False))
    assert meta["documents"] == 3 and meta["no_text"] == 1
    assert "row 1: 'messages' is not a list" in meta["shards"][0]["bad"][0]
    shards = [IndexedShard(tmp_path / "out" / s["name"]) for s in meta["shards"]]
    batch = Samples(DocSet.whole(TokenStore(shards)), "padded", seq_len=256, pad_id=0).collate(range(3))
    said = [[m["content"] for m in c if m["role"] == "assistant"] for c in
            (CONVERSATIONS[0], CONVERSATIONS[1], [{"role": "assistant", "content": "Hi!"}])]
    for labels, turns in zip(batch.labels, said):
        assert tokenizer.decode(labels[labels != IGNORE_INDEX].tolist(), skip_special_tokens=False) \
            == "".join(t + "<|im_end|>" for t in turns)
    # Rendered as the jsonl record is: the messages without a `meta` have none (not a null).
    template = ChatTemplate(QWEN, {"eos_token": "<|im_end|>"})
    inputs = batch.input_ids[1, :int(batch.attention_mask[1].sum())].tolist()
    assert inputs == tokens_and_targets(template, tokenizer, CONVERSATIONS[1])[0][:-1]  # eos last
    pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "docs.parquet")
    with pytest.raises(ConfigError, match=r"neither a 'messages' column nor 'prompt' and "
                                          r"'completion' \(its columns: text\)"):
        prepare_directory([tmp_path / "docs.parquet"], tmp_path / "x", PrepareSettings(
            tokenizer=str(model_dir), chat_template="auto", progress=False))
