"""Data written for the tests: the documents of the data-preparation tests in every format
megalite reads (TEXTS, write_inputs) and a tokenizer trained on them; jsonl files of texts
(write_jsonl) or of any records (write_records)."""
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from megalite.data.tokenizer import train_bpe


TEXTS = [f"Document {i}: caf\u00e9, tensors \u2014 and {'gradients ' * (i % 7)}\n  indented\n" for i in range(120)]


def tokenizer(tmp_path, vocab=400) -> Path:
    path = tmp_path / f"tok{vocab}.json"
    if not path.is_file():
        train_bpe(TEXTS, vocab).save(str(path))
    return path


def write_inputs(root: Path) -> dict[str, list[str]]:
    """The same kind of text in every format megalite reads; returns each file's documents."""
    root.mkdir(parents=True, exist_ok=True)
    parts = {name: TEXTS[i * 30:(i + 1) * 30] for i, name in
             enumerate(["a.jsonl.gz", "b.jsonl.zst", "c.parquet", "d.txt"])}
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(parts["a.jsonl.gz"]))
    (root / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    lines = "".join(json.dumps({"text": t}) + "\n" for t in parts["b.jsonl.zst"])
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    table = pa.table({"id": [str(i) for i in range(30)], "text": parts["c.parquet"],
                      "language": ["en"] * 30})
    pq.write_table(table, root / "c.parquet", row_group_size=7)
    # .txt documents are separated by two blank lines (their own edge newlines are dropped).
    parts["d.txt"] = [t.strip("\n") for t in parts["d.txt"]]
    (root / "d.txt").write_text("\n\n\n".join(parts["d.txt"]))
    return parts


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def write_records(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
