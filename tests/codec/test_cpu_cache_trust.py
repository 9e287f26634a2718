"""The fused CPU codec's cache never loads a library someone else could have written:
the opened file is what is checked and loaded (a folder swapped in a loop does not get its
library run), and every folder above the cache is checked (issue 58, item 1)."""

import ctypes
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from hhook.codec.kernels import cpu as cpu_kernels
from hhook.codec.kernels import trust

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "getuid") or not os.path.isdir("/proc/self/fd"), reason="Linux only"),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]

_SWAPPER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Swap two folders until *stop: the whole loop in C, so the GIL never paces it. */
long swap_loop(const char *a, const char *b, volatile int *stop) {
    long n = 0;
    while (!*stop) n += syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 2 /* RENAME_EXCHANGE */) == 0;
    return n;
}
int swap_once(const char *a, const char *b) {
    return (int)syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 2);
}
"""
_FOREIGN = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fputs("foreign code ran\n", f); fclose(f); }
}
void hh_prepare(void) {}
void hh_quantize(void) {}
void hh_decode(void) {}
"""


def _compile(source: str, out: Path, *defines: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    cc = cpu_kernels.compiler()
    subprocess.run([*cc, "-shared", "-fPIC", *defines, "-o", str(out), str(src)], check=True, timeout=120)
    return out


@pytest.fixture
def fresh_library(monkeypatch):
    """Every load in the test looks at the cache again; the module's library comes back after."""
    monkeypatch.setenv("HHOOK_FORCE_REFERENCE", "0")
    cpu_kernels._library.cache_clear()
    yield
    cpu_kernels._library.cache_clear()


class _Attack:
    """Another user's folder of the cache's layout holding a library (of uid 65534: as
    root here) whose constructor writes ``marker``, and a C swapper for two folders."""

    def __init__(self, tmp_path: Path):
        self.benign = Path(cpu_kernels.build())  # the real library, in the default cache
        self.marker = tmp_path / "marker"
        self.foreign = _compile(_FOREIGN, tmp_path / "foreign.so", f'-DMARKER="{self.marker}"')
        os.chown(self.foreign, 65534, 65534)
        self.swapper = ctypes.CDLL(str(_compile(_SWAPPER, tmp_path / "swapper.so")))
        self.swapper.swap_loop.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int))
        self.swapper.swap_loop.restype = ctypes.c_long
        self.shared = tmp_path / "shared"
        self.shared.mkdir(mode=0o700)

    def folders(self, i: int, monkeypatch):
        """A fresh pair (the dynamic loader reuses a library it loaded by the same name)."""
        mine, theirs = self.shared / f"cache{i}", self.shared / f"planted{i}"
        mine.mkdir(mode=0o700)
        theirs.mkdir(mode=0o700)
        monkeypatch.setenv("HHOOK_CACHE_DIR", str(mine))
        name = cpu_kernels.library_path(cpu_kernels.compiler()).name
        os.link(self.benign, mine / name)
        os.link(self.foreign, theirs / name)
        os.chown(theirs, 65534, 65534)
        return str(mine).encode(), str(theirs).encode()


@pytest.fixture
def attack(tmp_path):
    if os.getuid() != 0:
        pytest.skip("making a library of another uid needs root")
    return _Attack(tmp_path)


def test_a_folder_swapped_right_after_the_check_does_not_get_its_library_run(attack, monkeypatch, fresh_library):
    """The race won at the worst moment: the folders are exchanged (renameat2
    RENAME_EXCHANGE) just after the cache was checked. The path loaded again after its
    check was the foreign library (the loader before this change ran it every time); the
    opened file is what is checked now, and it is another uid's: refused, and the codec
    is built in a private folder."""
    mine, theirs = attack.folders(0, monkeypatch)
    checked = cpu_kernels.build

    def build_then_swap(*args, **kwargs):
        path = checked(*args, **kwargs)
        assert attack.swapper.swap_once(mine, theirs) == 0
        return path

    monkeypatch.setattr(cpu_kernels, "build", build_then_swap)
    assert cpu_kernels._library() is not None
    assert not attack.marker.exists(), "the foreign library ran"
    assert Path(cpu_kernels.build_info["path"]).parent != Path(mine.decode())


def test_a_folder_swapped_in_a_loop_never_gets_its_library_run(attack, monkeypatch, fresh_library):
    """The same with a thread exchanging the folders in a loop (in C, GIL released) while
    the codec loads, 20 times: whichever file the open finds is the one checked and
    loaded, so the foreign library never runs."""
    for i in range(20):
        mine, theirs = attack.folders(i, monkeypatch)
        stop = ctypes.c_int(0)
        worker = threading.Thread(target=attack.swapper.swap_loop, args=(mine, theirs, ctypes.byref(stop)))
        worker.start()
        try:
            cpu_kernels._library.cache_clear()
            lib = cpu_kernels._library()
        finally:
            stop.value = 1
            worker.join()
        assert lib is not None and not attack.marker.exists(), f"the foreign library ran (try {i})"


def test_a_symbolic_link_in_place_of_the_library_is_refused(tmp_path):
    real = tmp_path / "real.so"
    real.write_bytes(b"")
    (tmp_path / "link.so").symlink_to(real)
    with pytest.raises(trust.Untrusted, match="symbolic link"):
        trust.load(tmp_path / "link.so")


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o775, True), (0o1777, False), (0o755, False)])
def test_every_folder_above_the_cache_is_checked(tmp_path, monkeypatch, fresh_library, mode, refused):
    """A cache under a folder others may write without the sticky bit (a shared team
    folder) is not loaded: they could swap the cache for their own. One with the sticky
    bit, like /tmp, is used. Meaningful as root: the mode bits decide, root owns both."""
    team = tmp_path / "team"
    team.mkdir()
    cache = team / "me" / "hhook"
    cache.mkdir(parents=True, mode=0o700)
    team.chmod(mode)
    monkeypatch.setenv("HHOOK_CACHE_DIR", str(cache))
    assert cpu_kernels.available()
    where = Path(cpu_kernels.build_info["path"]).parent
    problem = trust.unsafe_folder(cache)
    if refused:
        assert where != cache and f"{team}, above the cache {cache}" in problem and "sticky" in problem
    else:
        assert where == cache and problem is None


def test_a_link_above_the_cache_is_checked_where_it_sits_and_where_it_points(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    private = tmp_path / "private"
    (private / "hhook").mkdir(parents=True, mode=0o700)
    (shared / "link").symlink_to(private)
    shared.chmod(0o777)
    assert str(shared) in trust.unsafe_folder(shared / "link" / "hhook")
    shared.chmod(0o755)
    assert trust.unsafe_folder(shared / "link" / "hhook") is None
    private.chmod(0o777)
    assert f"{shared / 'link'}, above" in trust.unsafe_folder(shared / "link" / "hhook")  # where it points
