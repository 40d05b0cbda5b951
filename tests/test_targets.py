"""Which tokens are targets, stored beside the tokens (a `.targets` side file per shard, a byte
per token) and carried into the labels: a token that is not a target (a prompt's) is never a
label, in padded and packed rows, from shards with and without the file; a truncated side file
is refused."""
import numpy as np
import pytest

from megalite.data.batches import Mixture, Samples
from megalite.data.docs import ArrayShard, DocSet, TokenStore
from megalite.data.indexed import IndexedShard, ShardWriter, targets_path
from megalite.parallel.vocab import IGNORE_INDEX
from megalite.typed_config import ConfigError

pytestmark = pytest.mark.unit

# Three conversations: token ids 100+ are prompt (not targets), 200+ answers (targets), 1 eos.
DOCS = [([100, 101, 200, 201, 1], [0, 0, 1, 1, 1]),
        ([102, 202, 1], [0, 1, 1]),
        ([103, 104, 105, 203, 204, 205, 1], [0, 0, 0, 1, 1, 1, 1])]


def write(prefix, docs, targets=True):
    writer = ShardWriter(prefix, np.uint16, targets=targets)
    writer.add(np.concatenate([d for d, _ in docs]), np.array([len(d) for d, _ in docs]),
               np.concatenate([t for _, t in docs]) if targets else None)
    writer.finish()
    return IndexedShard(prefix)


def check_labels(batch, shifted_targets):
    """Every label is a target token or -100; every target of the row is a label."""
    for row, labels in enumerate(batch.labels):
        real = labels[labels != IGNORE_INDEX]
        assert bool(((real >= 200) | (real == 1)).all()), labels  # never a prompt token
    assert int((batch.labels != IGNORE_INDEX).sum()) == shifted_targets


def test_targets_travel_into_the_labels(tmp_path):
    shard = write(tmp_path / "conv", DOCS)
    assert targets_path(tmp_path / "conv").stat().st_size == shard.n_tokens
    assert shard.has_targets and list(shard.targets) == [t for _, ts in DOCS for t in ts]
    store = TokenStore([shard])
    docs = DocSet.whole(store)
    padded = Samples(docs, "padded", seq_len=8, pad_id=0)
    batch = padded.collate(range(3))
    check_labels(batch, sum(sum(t[1:]) for _, t in DOCS))
    # Packed: windows across conversations; a label is the next token where it is a target of
    # the same conversation.
    packed = Samples(docs, "packed", seq_len=7, pad_id=0)
    batch = packed.collate(range(len(packed)))
    ids = np.array([i for d, _ in DOCS for i in d])
    targets = np.array([t for _, ts in DOCS for t in ts], dtype=bool)
    doc = np.repeat(np.arange(len(DOCS)), [len(d) for d, _ in DOCS])
    for k in range(len(packed)):
        at = np.arange(k * 7, k * 7 + 7)
        expected = np.where((doc[at + 1] == doc[at]) & targets[at + 1], ids[at + 1], IGNORE_INDEX)
        assert batch.labels[k].tolist() == expected.tolist()
    check_labels(batch, int((batch.labels != IGNORE_INDEX).sum()))


def test_a_source_without_targets_keeps_every_token(tmp_path):
    plain = write(tmp_path / "plain", DOCS, targets=False)
    assert not plain.has_targets and plain.targets is None
    conv = write(tmp_path / "conv", DOCS)
    mixture = Mixture([Samples(DocSet.whole(TokenStore([s])), "padded", 8, 0) for s in (plain, conv)],
                      [0.5, 0.5])
    batch = mixture.collate(np.array([[0, 0], [1, 0]]))
    # The plain row's every next token is a label; the conversation's only its answer's.
    assert batch.labels[0, :4].tolist() == [101, 200, 201, 1]
    assert batch.labels[1, :4].tolist() == [IGNORE_INDEX, 200, 201, 1]
    arrays = TokenStore([ArrayShard(np.array([5, 6, 7]), np.array([0, 3]), np.array([0, 1, 0], np.uint8))])
    assert arrays.has_targets and arrays.read_targets(np.arange(3)).tolist() == [False, True, False]


def test_a_truncated_targets_file_is_refused(tmp_path):
    write(tmp_path / "conv", DOCS)
    path = targets_path(tmp_path / "conv")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ConfigError, match=r"conv.targets.*not one per token"):
        IndexedShard(tmp_path / "conv")


def test_an_abandoned_writer_leaves_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "conv", np.uint16, targets=True)
    writer.add(np.array([1, 2]), np.array([2]), np.array([0, 1]))
    with pytest.raises(ValueError, match="targets must be given"):
        writer.add(np.array([1, 2]), np.array([2]))
    writer.abandon()
    assert list(tmp_path.iterdir()) == []
