"""Build a C source in kernels/csrc into a shared library on first use and cache it on disk.

The library lands in ``$PAGEDSERVE_KERNEL_CACHE`` (default ``~/.cache/pagedserve/kernels``) under
a name keyed by the source, the flags and the compiler, so another process (a restarted server, a
tensor-parallel worker) loads it without compiling, and a machine without a compiler loads what
``python -m pagedserve.kernels.build_all`` (``make install``) built there. A cached library is code this process runs, so
the directory and the file must belong to this user and be writable by no one else
(``check_private``): otherwise another user could swap the library, and the build is refused
with the reason (the kernel turns off; the torch path runs). Every C kernel builds here, with the
flags of the build kernels/isa.py chooses for this CPU (explicit ``-m`` options, never
``-march=native``, so a cached build stays valid on any machine with the same extensions).
``$CC`` (default gcc) and ``$XDG_CACHE_HOME`` are read here as every Unix tool reads them: they are
not pagedserve's switches, so contracts/env.py does not declare them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.contracts import env
from pagedserve.kernels import isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

class KernelBuildError(RuntimeError):
    """A C kernel cannot be built or loaded; the message says what to install or change."""


class CompilerMissing(KernelBuildError):
    """No C compiler on PATH (``$CC``, default gcc): the optional kernels turn off quietly."""


def cache_dir() -> Path:
    configured = env.KERNEL_CACHE.get()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve" / "kernels"


def build(source_name: str, extra_flags: list[str]) -> ctypes.CDLL:
    """Compile ``csrc/<source_name>`` with ``extra_flags`` (once per source+flags+compiler) and load it.
    Without a compiler, a build of the same source and flags that is already cached (``make install``
    put it there) loads; only a missing one raises CompilerMissing."""
    cc = os.environ.get("CC", "gcc")
    cc_path = shutil.which(cc)
    source = CSRC / source_name
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", *extra_flags]
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # shared headers
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    if cc_path is None:
        return _load_cached(source, key, f"building {source_name} needs a C compiler: {cc!r} is not on PATH "
                                         "(install gcc or set CC)")
    compiler = hashlib.sha256(cc_path.encode()).hexdigest()[:8]
    out = cache_dir() / f"{source.stem}-{key}-{compiler}.so"
    if out.parent.exists():
        check_private(out.parent)
    if out.is_file():
        check_private(out)
    else:
        logger.info("building %s: %s %s -> %s", source_name, cc, " ".join(flags), out)
        _compile(cc, flags, source, out)
    return ctypes.CDLL(str(out))


def _load_cached(source: Path, key: str, missing: str) -> ctypes.CDLL:
    """The newest cached build of ``source`` with this source+flags ``key`` (from whichever compiler
    built it), or CompilerMissing(``missing``) where there is none."""
    directory = cache_dir()
    built = sorted(directory.glob(f"{source.stem}-{key}-*.so"), key=lambda p: p.stat().st_mtime) \
        if directory.is_dir() else []
    if not built:
        raise CompilerMissing(missing)
    check_private(directory)
    check_private(built[-1])
    return ctypes.CDLL(str(built[-1]))


def check_private(path: Path) -> None:
    """Refuse a cache directory or library that another user owns or may write (KernelBuildError
    saying which and why): loading it would run whatever they put there."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise KernelBuildError(f"cannot check the kernel build cache {path}: {e}") from None
    what = "directory" if path.is_dir() else "library"
    fix = ("; set PAGEDSERVE_KERNEL_CACHE to a directory only this user can write "
           "(e.g. chmod 700 it), or remove it to have it rebuilt")
    if st.st_uid != os.getuid():
        raise KernelBuildError(f"refusing the kernel build cache {what} {path}: it is owned by uid "
                               f"{st.st_uid}, not by this user (uid {os.getuid()}){fix}")
    if st.st_mode & 0o022:
        who = "everyone" if st.st_mode & 0o002 else "its group"
        raise KernelBuildError(f"refusing the kernel build cache {what} {path}: it is writable by {who} "
                               f"(mode {st.st_mode & 0o777:o}), so another user could replace the "
                               f"code this process loads{fix}")


def build_kernel(name: str, choice: isa.Build) -> ctypes.CDLL:
    """Build (or load from the cache) the ``choice`` build of kernel ``name`` (kernels/isa.py)."""
    kernel = isa.KERNELS[name]
    return build(kernel.source_of(choice), kernel.flags(choice))


def build_or_none(name: str, choice: isa.Build, fallback: str) -> ctypes.CDLL | None:
    """``build_kernel``, or None with a warning naming ``fallback`` (the path that runs instead) when
    the compiler rejects the source: an optional kernel never stops the server."""
    try:
        return build_kernel(name, choice)
    except KernelBuildError as e:
        logger.warning("%s: the build failed, %s runs: %s", isa.KERNELS[name].source_of(choice), fallback, e)
        return None


_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL_X86_64 = 0x1023, 18, 158


@functools.cache
def amx_tiles_granted() -> bool:
    """Ask Linux once per process for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); every AMX
    kernel needs it before its first tile instruction. False where Linux refuses or is not x86-64."""
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL_X86_64), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                        ctypes.c_long(_XFEATURE_XTILEDATA)) == 0


def _compile(cc: str, flags: list[str], source: Path, out: Path) -> None:
    try:
        if not out.parent.exists():
            out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # private: see check_private
            check_private(out.parent)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel build cache {out.parent}: {e} "
                               "(set PAGEDSERVE_KERNEL_CACHE to a writable directory)") from None
    os.close(fd)
    cmd = [cc, *flags, str(source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelBuildError(f"building {source.name} failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.chmod(tmp, 0o755)  # whatever the umask: never group/world-writable (check_private)
        os.replace(tmp, out)  # atomic: a concurrent builder or loader sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
