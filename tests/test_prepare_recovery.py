"""`megalite prepare-data` when a run does not end well: a worker that dies, a file rewritten
while read, a failed or SIGKILLed run; whole shards are kept and the next run finishes the rest."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.data.raw_files import expand_inputs
from megalite.typed_config import ConfigError
from tests.support.data import TEXTS, tokenizer, write_inputs
from tests.support.launch import ROOT


def process_group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)"
        except OSError:  # it ended meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass


@pytest.mark.e2e
def test_a_worker_that_dies_is_an_error_naming_the_file_and_the_fix(tmp_path):
    """Killed as soon as it is seen (a sibling may still be starting): the run ends at once
    with the error, and no process of it is left."""
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t * 40}) + "\n" for t in TEXTS * 30))
    # Its own process group: whatever happens, every process of the run can be found and killed.
    proc = subprocess.Popen([sys.executable, "-m", "megalite", "prepare-data", "--input",
                             str(tmp_path / "b.jsonl"), "--tokenizer", str(tokenizer(tmp_path)),
                             "--workers", "2", "--out", str(tmp_path / "out")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline, workers = time.monotonic() + 120, []
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            for pid in children.read_text().split() if children.exists() else []:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in command and b"resource_tracker" not in command:
                    workers.append(int(pid))
            time.sleep(0.01)
        assert workers, "no worker seen"
        os.kill(workers[0], signal.SIGKILL)  # as the kernel's OOM killer would
        _, err = proc.communicate(timeout=120)
    except BaseException:  # hung, or no worker seen: nothing of the run may outlive the test
        kill_group(proc.pid)
        proc.communicate(timeout=60)
        raise
    deadline = time.monotonic() + 30  # multiprocessing's resource tracker ends once it sees EOF
    while process_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = process_group(proc.pid)
    kill_group(proc.pid)
    assert not left, f"processes left running: {left}"
    assert proc.returncode != 0
    assert re.search(r"a tokenizing worker died while preparing '.*b\.jsonl' \(most often: out of "
                     r"memory\): run again with fewer --workers", err), err[-2000:]
    assert not list((tmp_path / "out").glob("*.bin"))


@pytest.mark.unit
def test_a_file_rewritten_while_it_is_prepared_is_prepared_again_by_the_next_run(tmp_path, monkeypatch):
    import megalite.prep.shards as prepare_shards
    source = tmp_path / "x.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    read = prepare_shards.read_chunks

    def appended_while_read(path, *args):
        yield from read(path, *args)  # the file as it was: TEXTS
        with open(path, "a") as f:
            f.write(json.dumps({"text": "a late document"}) + "\n")

    settings = PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(prepare_shards, "read_chunks", appended_while_read)
        assert prepare_directory([source], tmp_path / "out", settings)["documents"] == len(TEXTS)
    assert prepare_directory([source], tmp_path / "out", settings)["documents"] == len(TEXTS) + 1


@pytest.mark.e2e
def test_a_failed_run_keeps_its_whole_shards_and_a_rerun_prepares_only_what_is_missing(tmp_path):
    write_inputs(tmp_path / "in")
    (tmp_path / "in" / "e.jsonl").write_text('{"text": "ok"}\nnot json\n')
    files = expand_inputs([str(tmp_path / "in")])
    strict = PrepareSettings(tokenizer=str(tokenizer(tmp_path)), strict=True, workers=2, progress=False)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"e\.jsonl:2"):  # dies after the first shards are whole
        prepare_directory(files, out, strict)
    done = sorted(p.name for p in out.glob("[0-9]*.json"))  # the shards' markers
    assert done == [f"0000{i}-{f.name}.json" for i, f in enumerate(files[:4])]
    assert not (out / "meta.json").exists() and not list(out.glob("00004-*")) and not list(out.glob(".*tmp"))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("0000[0-3]-*")}
    (tmp_path / "in" / "e.jsonl").write_text('{"text": "ok"}\n{"text": "fixed"}\n')
    meta = prepare_directory(files, out, strict)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("0000[0-3]-*")} == before
    assert meta["documents"] == 122
    # Other settings make other shards: a re-run with them redoes every file.
    meta = prepare_directory(files, out, PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    assert all(p.stat().st_mtime_ns != before[p.name] for p in out.glob("0000[0-3]-*"))


@pytest.mark.e2e
def test_a_sigkilled_run_leaves_no_half_shard_and_the_rerun_matches_a_clean_run(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t * 40}) + "\n" for t in TEXTS * 30))
    command = [sys.executable, "-m", "megalite", "prepare-data", "--input", str(tmp_path / "a.jsonl"),
               str(tmp_path / "b.jsonl"), "--tokenizer", str(tokenizer(tmp_path)), "--workers", "1"]
    out = tmp_path / "killed"
    proc = subprocess.Popen(command + ["--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    partial = out / ".00001-b.jsonl.bin.tmp"
    deadline = time.monotonic() + 120
    while not (partial.is_file() and partial.stat().st_size) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the main process and its worker, mid-file
    proc.wait(timeout=60)
    assert (out / "00000-a.jsonl.json").is_file(), "killed before the first shard was whole"
    assert not (out / "00001-b.jsonl.bin").exists() and not (out / "00001-b.jsonl.idx").exists()
    assert not (out / "meta.json").exists()
    before = (out / "00000-a.jsonl.bin").stat().st_mtime_ns
    assert subprocess.run(command + ["--out", str(out)], cwd=ROOT, capture_output=True,
                          timeout=300).returncode == 0
    assert (out / "00000-a.jsonl.bin").stat().st_mtime_ns == before  # not prepared again
    assert subprocess.run(command + ["--out", str(tmp_path / "clean")], cwd=ROOT,
                          capture_output=True, timeout=300).returncode == 0
    for name in ("00000-a.jsonl", "00001-b.jsonl"):
        for suffix in (".bin", ".idx"):
            assert (out / (name + suffix)).read_bytes() == (tmp_path / "clean" / (name + suffix)).read_bytes()
