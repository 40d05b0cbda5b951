"""`megalite eval` split over ranks: the text is cut into pieces at line boundaries
(megalite/data/text_pieces.py), each DP rank reads and tokenizes only its own pieces, and the
loss at DP=2 equals DP=1's and a computation made here piece by piece."""
import dataclasses
import io
import json
import math
import random
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import processors

from megalite import evaluate
from megalite.config import ParallelConfig
from megalite.data import text_pieces
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer, train_bpe
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.typed_config import ConfigError
from tests.support.checkpoints import WeightsOnly, save_checkpoint
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS

SMALL = 512  # PIECE_BYTES in these tests: the eval text is about 5 pieces
WORDS = ["tensor", "parallel", "café", "naïve", "€uro", "😀", "übung", "日本語", "model", "data"]


def text(seed: int, lines: int) -> str:
    """Lines of words with 2-, 3- and 4-byte characters, of varied lengths, one much longer
    than SMALL (it spans several pieces' nominal starts), and no newline at the end."""
    rng = random.Random(seed)
    rows = [" ".join(rng.choices(WORDS, k=rng.randint(0, 14))) for _ in range(lines)]
    rows[lines // 3] = " ".join(rng.choices(WORDS, k=300))
    return "\n".join(rows)


def cut(data: bytes, piece_bytes: int) -> list[bytes]:
    """The rule, applied here to the whole file: piece k > 0 starts just after the first
    newline at or after byte k * piece_bytes; empty pieces dropped."""
    starts = [0]
    for k in range(1, math.ceil(len(data) / piece_bytes)):
        newline = data.find(b"\n", k * piece_bytes)
        starts.append(len(data) if newline < 0 else newline + 1)
    starts.append(len(data))
    return [data[a:b] for a, b in zip(starts, starts[1:]) if b > a]


def read_by_rank(path, ranks: int, monkeypatch) -> list[tuple[list[str], int]]:
    """Per rank: its pieces and the bytes it read (counted at every read and readline)."""
    counted = [0]

    class Counted(io.BufferedReader):
        def read(self, size=-1):
            data = super().read(size)
            counted[0] += len(data)
            return data

        def readline(self, size=-1):
            data = super().readline(size)
            counted[0] += len(data)
            return data

    monkeypatch.setattr(text_pieces, "open", lambda p, mode: Counted(io.FileIO(p, mode[0])),
                        raising=False)
    out = []
    for rank in range(ranks):
        counted[0] = 0
        pieces = list(text_pieces.rank_pieces(path, rank, ranks))
        out.append((pieces, counted[0]))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("content", ["lines", "one line", "empty", "newlines at starts"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 7])
def test_pieces_follow_the_rule_and_each_rank_reads_only_its_own(tmp_path, monkeypatch,
                                                                 content, ranks):
    monkeypatch.setattr(text_pieces, "PIECE_BYTES", SMALL)
    data = {"lines": text(1, 60).encode(),
            "one line": ("😀é" * 700).encode(),  # 4200 bytes, no newline: one piece
            "empty": b"",
            # Newlines just before and at byte SMALL, at byte 2 * SMALL and as the last byte.
            "newlines at starts": b"a" * (SMALL - 1) + b"\n\n" + b"b\n" * SMALL}[content]
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    expected = cut(data, SMALL)
    assert len(expected) == {"lines": 7, "one line": 1, "empty": 0, "newlines at starts": 3}[content]
    per_rank = read_by_rank(path, ranks, monkeypatch)
    pieces = [p for mine, _ in per_rank for p in mine]
    # In order over the ranks, whole characters each (strict decoding), the file once.
    assert pieces == [p.decode("utf-8") for p in expected]
    assert "".join(pieces) == data.decode("utf-8")
    nominal = np.array_split(np.arange(math.ceil(len(data) / SMALL)), ranks)
    for (mine, read), starts in zip(per_rank, nominal):
        assert read <= len("".join(mine).encode()) + len(starts) * SMALL
        if content == "lines" and ranks > 1:
            assert read < 0.75 * len(data)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as each torchrun rank has (two fight over a busy machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama-shaped model whose tokenizer puts bos first, as Llama's: each piece is a
    document of its own, with its bos."""
    root = tmp_path_factory.mktemp("eval-split")
    tokenizer = train_bpe([text(seed, 40) for seed in range(3)], 300)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.token_to_id("<|bos|>"))])
    tokenizer.save(str(root / "tokenizer.json"))
    cfg = dataclasses.replace(CONFIGS["llama"], vocab_size=300, max_seq_len=32)
    model = GPT(cfg, ParallelState(), seed=3)
    meta = {"config": {"model": dataclasses.asdict(cfg)}, "tokens": 0}
    ckpt = save_checkpoint(root / "run", 0, model, WeightsOnly(), {"cpu": torch.get_rng_state()},
                           meta, ParallelState(), keep=1,
                           tokenizer=load_tokenizer(root / "tokenizer.json"))
    return ckpt, model.eval()


@torch.no_grad()
def expected_loss(model: GPT, tokenizer: TokenizerInfo, pieces: list[bytes]) -> tuple[float, int]:
    """The mean next-token loss over windows of 32 ids of each piece, tokenized alone."""
    total, count = 0.0, 0
    for piece in pieces:
        ids = tokenizer.encode(piece.decode())
        assert ids[0] == tokenizer.bos_id
        for start in range(0, len(ids), 32):
            window = torch.tensor([ids[start:start + 32]])
            logits = model.full_logits(model(window).logits)[0, :-1]
            total += F.cross_entropy(logits, window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    return total / count, count


def eval_on_rank(ckpt: str, path: str, piece_bytes: int, patch=setattr,
                 layout: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """What `megalite eval` prints on this rank, and the texts it tokenized (`patch`: how to
    set PIECE_BYTES and the recording encode; monkeypatch.setattr in the test's process)."""
    patch(text_pieces, "PIECE_BYTES", piece_bytes)
    seen, encode = [], TokenizerInfo.encode
    patch(TokenizerInfo, "encode", lambda self, t: seen.append(t) or encode(self, t))
    out = io.StringIO()
    with redirect_stdout(out):
        assert evaluate.main(["--ckpt", ckpt, "--text", path, "--json", *layout]) == 0
    return out.getvalue(), seen


@pytest.mark.exactness
def test_the_loss_at_dp2_equals_dp1_and_the_pieces_scored_here(checkpoint, tmp_path, monkeypatch):
    ckpt, model = checkpoint
    path = tmp_path / "eval.txt"
    path.write_text(text(7, 50))
    pieces = cut(path.read_bytes(), SMALL)
    assert len(pieces) == 5
    printed, seen = eval_on_rank(str(ckpt), str(path), SMALL, monkeypatch.setattr)
    one = json.loads(printed)
    assert seen == [p.decode() for p in pieces]

    ranks = run_distributed(eval_on_rank, 2, str(ckpt), str(path), SMALL, torchrun_env=True)
    two = json.loads(ranks[0][0])
    assert ranks[1][0] == ""  # printed once
    assert two["tokens"] == one["tokens"] and two["loss"] == pytest.approx(one["loss"], rel=1e-12)
    # Each rank tokenized its own block of pieces only, never the whole text.
    assert ranks[0][1] + ranks[1][1] == seen and ranks[0][1] and ranks[1][1]

    loss, count = expected_loss(model, load_tokenizer(ckpt), pieces)
    assert one["tokens"] == count and one["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.exactness
@pytest.mark.parametrize("layout", [("--pp", "2"), ("--cp", "2")])
def test_the_loss_at_pp2_and_cp2_equals_one_process(checkpoint, tmp_path, monkeypatch, layout):
    """Training's validation and `megalite eval` share one loss (training/evaluation.py): eval
    runs the layouts training does."""
    path = tmp_path / "eval.txt"
    path.write_text(text(7, 50))
    one = json.loads(eval_on_rank(str(checkpoint[0]), str(path), SMALL, monkeypatch.setattr)[0])
    ranks = run_distributed(eval_on_rank, 2, str(checkpoint[0]), str(path), SMALL, setattr, layout,
                            torchrun_env=True)
    two = json.loads(ranks[0][0])
    assert ranks[1][0] == ""  # printed once
    assert two["tokens"] == one["tokens"] and two["loss"] == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.unit
def test_a_cp_that_widens_a_window_past_the_positions_is_refused():
    evaluate.check_windows_split(32, ParallelConfig(cp=2))  # 31 tokens widen to 32
    with pytest.raises(ConfigError, match=r"--cp 2 cuts each window into 4 equal chunks.*max_seq_len=30"):
        evaluate.check_windows_split(30, ParallelConfig(cp=2))  # 29 widen to 32


@pytest.mark.unit
def test_a_text_under_the_piece_size_is_scored_whole(checkpoint, tmp_path, capsys):
    ckpt, model = checkpoint
    path = tmp_path / "eval.txt"
    path.write_text(text(7, 50))
    assert path.stat().st_size < text_pieces.PIECE_BYTES
    assert evaluate.main(["--ckpt", str(ckpt), "--text", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    loss, count = expected_loss(model, load_tokenizer(ckpt), [path.read_bytes()])
    assert result["tokens"] == count and result["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.unit
def test_a_text_with_nothing_to_predict_is_refused(checkpoint, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"empty\.txt' is empty: nothing to predict"):
        evaluate.main(["--ckpt", str(checkpoint[0]), "--text", str(path)])
