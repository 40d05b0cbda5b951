"""A process's own counters, read from /proc (Linux): its memory sizes and peak, and the bytes
of its read and write calls."""
from __future__ import annotations

from pathlib import Path


def status_bytes(pid: int | str = "self") -> dict[str, int]:
    """The sizes in /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile, ...), in bytes."""
    sizes = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if len(fields) == 2 and fields[1] == "kB":
            sizes[key] = int(fields[0]) * 1024
    return sizes


def io_bytes() -> dict[str, int]:
    """This process's /proc/self/io: rchar and wchar count the bytes of every read and write
    call, page cache or not; a memory map's reads are in none of them."""
    return {k: int(v) for k, v in (line.split(": ") for line in
                                   Path("/proc/self/io").read_text().splitlines())}


def reset_peak_rss() -> None:
    """VmHWM := VmRSS for this process, so the next VmHWM is the peak of what runs next."""
    Path("/proc/self/clear_refs").write_text("5")


def hwm_bytes(pid: int) -> int:
    """The process's own peak RSS so far (VmHWM), 0 if it is gone."""
    try:
        return status_bytes(pid).get("VmHWM", 0)
    except (OSError, ValueError):
        return 0
