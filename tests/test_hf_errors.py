"""Bad Hugging Face input and output paths, each one `megalite: error:` line naming the path and
the fix (exit status 2): a cut-off or corrupt safetensors file, on import and under
train.init_from (before any collective), and an export onto a file."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megalite import cli
from megalite.hf.convert import export_hf, import_hf, pretrained_config
from megalite.typed_config import ConfigError
from tests.support.hf import random_hf_model

ROOT = Path(__file__).resolve().parent.parent


def whole_model_error(path: Path, reason: str) -> str:
    return f"'{path}' is not a whole safetensors file ({reason}): download or export it again"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_file):  # noqa: F811
    """A GPT-2 in one model.safetensors and a Llama in shards, as transformers saves them."""
    root = tmp_path_factory.mktemp("hf")
    for name in ("gpt2", "llama"):
        random_hf_model(name, root / name, tokenizer_file)
    return root


def cut(hf_dirs, tmp_path, name: str, file: str, keep) -> Path:
    """A copy of the model `name` whose `file` keeps its first keep(size) bytes."""
    hf = tmp_path / name
    shutil.copytree(hf_dirs / name, hf)
    data = (hf / file).read_bytes()
    (hf / file).write_bytes(data[:keep(len(data))])
    return hf


# What safetensors says of each: the data cut short (an interrupted download), the header cut.
CUTS = {"the data": (lambda n: n - 8, "incomplete metadata, file not fully covered"),
        "the header": (lambda n: 100, "invalid header length"),
        "all but 4 bytes": (lambda n: 4, "header too small")}


@pytest.mark.unit
@pytest.mark.parametrize("where", sorted(CUTS))
def test_import_of_a_cut_off_file_is_one_line_naming_it(hf_dirs, tmp_path, capsys, where):
    keep, reason = CUTS[where]
    hf = cut(hf_dirs, tmp_path, "gpt2", "model.safetensors", keep)
    assert cli.main(["import", "--from-hf", str(hf), "--to", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == \
        f"megalite: error: {whole_model_error(hf / 'model.safetensors', reason)}\n"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.unit
def test_a_cut_off_shard_is_named_before_anything_is_written(hf_dirs, tmp_path, capsys):
    shards = sorted(p.name for p in (hf_dirs / "llama").glob("model-*.safetensors"))
    assert len(shards) > 2
    hf = cut(hf_dirs, tmp_path, "llama", shards[-1], lambda n: n // 2)
    assert cli.main(["import", "--from-hf", str(hf), "--to", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == "megalite: error: " + whole_model_error(
        hf / shards[-1], "incomplete metadata, file not fully covered") + "\n"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.unit
def test_init_from_a_cut_off_file_is_refused_while_reading_its_config(hf_dirs, tmp_path):
    hf = cut(hf_dirs, tmp_path, "gpt2", "model.safetensors", lambda n: n - 8)
    with pytest.raises(ConfigError) as refused:
        pretrained_config(hf)  # run_setup.with_pretrained: on every rank, before any collective
    assert str(refused.value) == whole_model_error(hf / "model.safetensors",
                                                   "incomplete metadata, file not fully covered")


@pytest.mark.e2e
def test_init_from_a_cut_off_file_under_megalite_torchrun_is_one_line_and_status_2(hf_dirs, tmp_path):
    hf = cut(hf_dirs, tmp_path, "gpt2", "model.safetensors", lambda n: n - 8)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "tensor parallel training"}\n' * 40)
    # A run that would start but for the file (the weights were read after the process group).
    run = [f"train.init_from={hf}", f"data.path={corpus}", "data.seq_len=32", "data.val_fraction=0.0",
           f"data.cache_dir={tmp_path / 'cache'}", "parallel.tp=2", "train.max_steps=1",
           "train.global_batch_size=2", "train.micro_batch_size=2", f"run.dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, "-m", "megalite", "torchrun", "--nproc_per_node", "2",
                           "-m", "megalite.train", *run], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert [line for line in done.stderr.splitlines() if "megalite: error" in line] == [
        "megalite: error: " + whole_model_error(hf / "model.safetensors",
                                                "incomplete metadata, file not fully covered")]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def ckpt(hf_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("imported") / "ckpt"
    import_hf(hf_dirs / "gpt2", path)
    return path


@pytest.mark.unit
@pytest.mark.parametrize("under", ["", "sub/dir"])
def test_export_onto_a_file_is_one_line_naming_it(ckpt, tmp_path, capsys, under):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / under
    assert cli.main(["export", "--ckpt", str(ckpt), "--to-hf", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"megalite: error: '{tmp_path / 'file'}' is a file: give --to-hf a directory (a new one, "
        f"or an earlier export's, whose model files are replaced)\n")
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.unit
def test_export_into_an_earlier_export_replaces_its_model_files(ckpt, tmp_path):
    """As --to-hf's help says: a loader finds only the new weights; other files are kept."""
    out = tmp_path / "hf"
    export_hf(ckpt, out, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    (out / "README.md").write_text("notes")
    export_hf(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
