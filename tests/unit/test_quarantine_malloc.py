"""tests/stress/quarantine_malloc.c, the heap checker of the stress loops: built with gcc and preloaded into a
real Python process, it reports a write into a freed chunk (with the bytes written) and a write past a
chunk's end, and nothing for a clean process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "stress" / "quarantine_malloc.c"

# The scripts below: a chunk of argv[1] bytes from libc's malloc (the preloaded one), argv[2] an offset into
# it, argv[3] a mode.
CHUNK = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size, offset, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
p = libc.malloc(size)
"""

# Freed or not, then 4 bytes of 0x41 written at the offset; mode 2: freed twice instead.
WRITE = (
    CHUNK
    + """if mode == "2":
    libc.free(p)
    libc.free(p)
    sys.exit()
if mode == "1":
    libc.free(p)
ctypes.memset(p + offset, 0x41, 4)
if mode == "0":
    libc.free(p)
"""
)


@pytest.fixture(scope="module")
def preload(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build tests/stress/quarantine_malloc.c"
    out = tmp_path_factory.mktemp("qm") / "quarantine_malloc.so"
    subprocess.run(
        [gcc, "-O2", "-fno-builtin", "-fPIC", "-shared", "-o", str(out), str(SOURCE), "-lpthread"], check=True
    )
    return out


def _run(preload: Path, reports: Path, *args: str) -> list[str]:
    env = {"LD_PRELOAD": str(preload), "QM_DIR": str(reports), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", WRITE, *args], env=env, check=True, capture_output=True)
    return [p.read_text() for p in sorted(reports.glob("*.log"))]


def test_a_write_after_free_is_reported_with_its_bytes(preload, tmp_path):
    (text,) = _run(preload, tmp_path, "48", "8", "1")
    assert "write after free" in text and "of 48 bytes" in text
    first = next(line for line in text.splitlines() if line.startswith("bytes"))
    assert first.split(":")[1].split()[6:14] == ["a5", "a5", "41", "41", "41", "41", "a5", "a5"]
    assert "freed at:" in text


def test_a_write_past_the_end_is_reported_at_free(preload, tmp_path):
    (text,) = _run(preload, tmp_path, "40", "40", "0")
    assert "write past the chunk's end" in text
    canary = next(line for line in text.splitlines() if line.startswith("canary")).split()[1:]
    assert canary[:6] == ["41", "41", "41", "41", "c3", "c3"]


def test_a_double_free_is_reported(preload, tmp_path):
    (text,) = _run(preload, tmp_path, "64", "0", "2")
    assert "double free (the chunk is in quarantine)" in text and "of 64 bytes" in text


def test_a_clean_process_has_no_report_and_counts_its_quarantine(preload, tmp_path):
    assert _run(preload, tmp_path, "48", "0", "0") == []
    (stats,) = [p.read_text() for p in (tmp_path / "stats").iterdir()]
    assert "reports 0" in stats and int(stats.split()[1]) > 0  # chunks went through the quarantine


# Frees a chunk of argv[1] bytes, then 5000 others (past a quarantine of 64), then writes into the first:
# caught only where the quarantine grew when the process's command line matched QM_BIG_MATCH (argv[2]).
LATE_WRITE = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
# the scanner, every QM_SCAN_S=1 s, reads the command line, grows the quarantine and writes its stats
stats = os.path.join(os.environ["QM_DIR"], "stats", str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if os.path.exists(stats) and " of 100000," in open(stats).read():
        break
    time.sleep(0.2)
p = libc.malloc(int(sys.argv[1]))
libc.free(p)
others = [libc.malloc(32) for _ in range(5000)]
for q in others:
    libc.free(q)
ctypes.memset(p + 8, 0x41, 4)
"""


@pytest.mark.parametrize("size", [48, 300_000])  # a tcache-sized chunk; one glibc would have mmapped
def test_a_matching_process_grows_its_quarantine_and_catches_a_late_write(preload, tmp_path, size):
    env = {
        "LD_PRELOAD": str(preload),
        "QM_DIR": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "QM_CAP": "64",
        "QM_SCAN_S": "1",
        "QM_BIG_MATCH": "qm-grow-token",
        "QM_BIG_CAP": "100000",
        "QM_BIG_MAX_SIZE": "1000000",
    }
    subprocess.run(
        [sys.executable, "-c", LATE_WRITE, str(size), "qm-grow-token"],
        env=env,
        check=True,
        capture_output=True,
    )
    (stats,) = [p.read_text() for p in (tmp_path / "stats").iterdir()]
    assert " of 100000," in stats, stats
    (text,) = [p.read_text() for p in tmp_path.glob("*.log")]
    assert "write after free" in text and f"of {size} bytes" in text


# A guarded chunk (QM_GUARD_MIN and over) of argv[1] bytes, filled, then: freed and written at argv[2]
# (mode w), freed and read there (r), written at argv[2] while live (o: past its end when argv[2] >= size), or
# written there and then freed (f).
GUARDED = (
    CHUNK
    + """import resource
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the faults are on purpose: no core file of them
ctypes.memset(p, 7, size)
if mode in "wr":
    libc.free(p)
if mode == "r":
    ctypes.string_at(p + offset, 4)
else:
    ctypes.memset(p + offset, 0x41, 4)
if mode == "f":
    libc.free(p)
print("no fault")
"""
)


def _guarded(preload: Path, reports: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {
        "LD_PRELOAD": str(preload),
        "QM_DIR": str(reports),
        "PATH": "/usr/bin:/bin",
        "QM_GUARD_MIN": "65536",
        "PYTHONFAULTHANDLER": "1",
    }
    proc = subprocess.run([sys.executable, "-c", GUARDED, *args], env=env, capture_output=True, text=True)
    return proc, "".join(p.read_text() for p in sorted(reports.glob("*.log")))


@pytest.mark.parametrize("mode", ["w", "r"])
def test_an_access_to_a_freed_guarded_chunk_faults_where_it_happens(preload, tmp_path, mode):
    """A write or a read after the free, a page past the chunk's start: the process stops at that access
    with the report (the chunk, the offset) and then faulthandler's Python stack names the line."""
    proc, text = _guarded(preload, tmp_path, "1000000", "5000", mode)
    assert proc.returncode == -11 and "no fault" not in proc.stdout
    assert "access to a freed chunk (SIGSEGV)" in text and "of 1000000 bytes +5000" in text
    assert "freed at:" in text and "found at:" in text
    access = "ctypes.string_at(p + offset" if mode == "r" else "ctypes.memset(p + offset"
    line = next(i for i, text in enumerate(GUARDED.splitlines(), 1) if access in text)
    assert f'File "<string>", line {line} in <module>' in proc.stderr


def test_a_write_past_a_guarded_chunks_end_faults(preload, tmp_path):
    proc, text = _guarded(preload, tmp_path, "1000000", "1000000", "o")  # 1000000: a multiple of 16
    assert proc.returncode == -11 and "in no freed guarded chunk" in text


def test_a_guarded_process_without_faults_runs_and_counts_its_guarded_chunks(preload, tmp_path):
    proc, text = _guarded(preload, tmp_path, "1000000", "0", "f")
    assert proc.returncode == 0 and "no fault" in proc.stdout and text == ""
    (stats,) = [p.read_text() for p in (tmp_path / "stats").iterdir()]
    assert int(stats.split("guarded ")[1].split()[0]) >= 1, stats  # the 1 MB chunk at least
