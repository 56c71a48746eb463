"""A wall clock that a test can step, for processes started under libfaketime (Debian's ``faketime``,
which ``scripts/setup.sh dev`` installs).

A :class:`SteppableClock` is a file holding an offset in seconds (``+12``, ``-5``); a process started
with :meth:`SteppableClock.env` reads its wall clock (``time()``, ``gettimeofday``,
``clock_gettime(CLOCK_REALTIME)``) as the real one plus that offset, and re-reads the file every
second (``FAKETIME_CACHE_DURATION``; a step is seen within two), so :meth:`SteppableClock.step`
steps the clock of a running process, as an NTP correction or a restored VM does. Its monotonic clocks
(``CLOCK_MONOTONIC``, ``CLOCK_BOOTTIME``) are left alone, as a real step leaves them.

libfaketime 0.9.10 (Debian 12's) breaks ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` when
told not to fake the monotonic clock: it shifts the deadline by the offset and the kernel answers
``EINVAL`` (libfaketime issue 426), which is how Python 3.11's ``time.sleep`` sleeps. So the
environment preloads a small shim before it that sends monotonic sleeps straight to the kernel; it
is compiled once with the system's C compiler (``cc``). :func:`clock_step_missing` says why steps
cannot be made here (``None`` when they can).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["SteppableClock", "clock_step_missing", "libfaketime"]

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

/* Monotonic sleeps go to the kernel as asked; the wall clock's go on to libfaketime. */
int clock_nanosleep(clockid_t clock, int flags, const struct timespec *req, struct timespec *rem) {
    if (clock == CLOCK_MONOTONIC || clock == CLOCK_BOOTTIME) {
        long r = syscall(SYS_clock_nanosleep, clock, flags, req, rem);
        return r == -1 ? errno : 0;
    }
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (!next) next = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock, flags, req, rem);
}
"""


def libfaketime() -> str | None:
    """The path of ``libfaketime.so.1`` (Debian's multiarch directory), or None."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def _shim() -> Path:
    """The compiled shim (above), in a directory of the temporary directory named by its source."""
    digest = hashlib.sha256(_SHIM.encode()).hexdigest()[:12]
    where = Path(tempfile.gettempdir()) / f"onceflow-faketime-shim-{digest}"
    lib = where / "monotonic_sleep.so"
    if where.exists():  # preloaded into servers: only a directory of our own that nobody else can write to
        st = where.lstat()
        if not where.is_dir() or where.is_symlink() or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(f"{where} is not a directory of this user's that only it can write to")
    if lib.exists():
        return lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the monotonic-sleep shim for libfaketime")
    where.mkdir(mode=0o755, exist_ok=True)
    src = where / "monotonic_sleep.c"
    src.write_text(_SHIM)
    tmp = where / f"monotonic_sleep.{tempfile.gettempprefix()}.so"
    subprocess.run(  # noqa: S603 - the system's compiler on our own source
        [cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"], check=True, capture_output=True, timeout=60
    )
    tmp.chmod(0o755)
    tmp.replace(lib)  # whole, or not at all: another process may be building it too
    return lib


def clock_step_missing() -> str | None:
    """Why a :class:`SteppableClock` cannot be used here; None when it can."""
    if libfaketime() is None:
        return "libfaketime is not installed (Debian's faketime package; scripts/setup.sh dev installs it)"
    try:
        _shim()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"the monotonic-sleep shim for libfaketime could not be built: {exc}"
    return None


class SteppableClock:
    """The wall clock of the processes started with :meth:`env`: the real one plus :attr:`offset`.

    ``path`` is the file the offset is kept in; its directory must be readable by those processes
    (PostgreSQL runs as ``nobody`` when we are root). Starts at ``+0``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".new")
        tmp.write_text(f"{self.offset:+d}\n")
        tmp.chmod(0o644)
        tmp.replace(self.path)  # a reader sees the old offset or the new one, never half of one

    def env(self) -> dict[str, str]:
        """The environment variables that put a process on this clock."""
        lib = libfaketime()
        if lib is None:
            raise RuntimeError(str(clock_step_missing()))
        return {
            "LD_PRELOAD": f"{_shim()}:{lib}",
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_CACHE_DURATION": "1",  # a step is seen within two seconds; no file read per call
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, seconds: int) -> int:
        """Step the clock by whole ``seconds`` (forward if positive); its new offset from the real clock."""
        self.offset += seconds
        self._write()
        return self.offset

    def reset(self) -> int:
        """Back to the real time (a step of minus the offset); the size of that step."""
        back = -self.offset
        self.step(back)
        return back
