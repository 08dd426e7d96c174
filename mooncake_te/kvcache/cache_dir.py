# SPDX-License-Identifier: Apache-2.0
"""Whether a path can be the SSD tier's ``cache_dir``: one answer for the cache (which
creates it) and ``mooncake-te doctor`` (which only looks), so both say the same thing.

The rule: the cache creates ``cache_dir`` itself only when its parent directory exists
(``mkdir``, not ``mkdir -p``). A missing parent usually means the SSD is not mounted, and
creating the whole path would put the cache on the root file system instead, where it
fills the disk the system runs from.
"""
from __future__ import annotations

import errno
import os
import tempfile

# File systems that hold no data of their own: a cache_dir there is a mistake however
# the write fails.
PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
             "devpts", "configfs", "pstore", "bpf", "fusectl", "mqueue", "hugetlbfs",
             "binfmt_misc", "autofs", "efivarfs", "nsfs", "rpc_pipefs"}
SSD = "point cache_dir at a directory on a local SSD"


def mount_of(path: str) -> tuple[str, str]:
    """``(mount point, file system type)`` of the deepest mount holding ``path``, from
    /proc/self/mounts (``("", "")`` when unreadable)."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2])
    except OSError:
        pass
    return best


def problem(path: str, create: bool) -> tuple[str, str, str] | None:
    """Why ``path`` cannot be the cache directory: ``(code, message, what to do)``, or
    None. ``code`` is the doctor's: MTE400 (missing, not a directory), MTE401 (cannot
    write there). ``create``: make ``path`` when only its last level is missing (the
    cache); without it (the doctor) a creatable ``path`` is no problem."""
    where = f"[kvcache] cache_dir = {path!r}"
    full = os.path.abspath(path)
    if not os.path.lexists(full):
        parent = os.path.dirname(full)
        if not os.path.isdir(parent):
            up = parent
            while not os.path.lexists(up):
                up = os.path.dirname(up)
            if not os.path.isdir(up):
                return ("MTE400", f"{where} cannot be a directory: {up!r} is a file, not a "
                                  f"directory", SSD)
            return ("MTE400", f"{where} does not exist, nor does its parent {parent!r}; the "
                              f"cache creates only the last level, so that an unmounted SSD "
                              f"does not put it on the root file system",
                    f"is the SSD mounted? mount it, or create the folder: mkdir -p {full}")
        if not create:                      # would the cache be able to make it?
            try:
                fd, probe = tempfile.mkstemp(prefix=".mte-probe-", dir=parent)
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                return _unwritable(where, parent, e, "cannot create it in")
            return None
        try:
            os.mkdir(full)
        except FileExistsError:
            pass                            # another process made it meanwhile
        except OSError as e:
            return _unwritable(where, parent, e, "cannot create it in")
    if not os.path.isdir(full):
        return ("MTE400", f"{where} is not a directory", SSD)
    # Try it rather than trust mode bits: ACLs, read-only mounts and root squash all make
    # os.access() lie.
    try:
        fd, probe = tempfile.mkstemp(prefix=".mte-probe-", dir=full)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return _unwritable(where, full, e, "cannot write a file in")
    return None


def _unwritable(where: str, directory: str, e: OSError, doing: str) -> tuple[str, str, str]:
    mnt, fstype = mount_of(directory)
    msg = f"{where} is not writable: {doing} {directory!r} ({e.strerror or e})"
    if fstype in PSEUDO_FS:
        return ("MTE401", f"{msg}: it is on a {fstype} file system (mounted at {mnt}), "
                          f"which holds no files of its own", SSD)
    if e.errno == errno.EROFS:
        return ("MTE401", f"{msg}: the file system at {mnt or '?'} is mounted read-only",
                f"remount it read-write, or {SSD}")
    if e.errno in (errno.EACCES, errno.EPERM):
        st = os.stat(directory)
        if st.st_uid != os.geteuid():
            return ("MTE401", f"{msg}: uid {os.geteuid()} may not write there (owner uid "
                              f"{st.st_uid}, mode {st.st_mode & 0o7777:o})",
                    f"chown {os.geteuid()} {directory} or chmod u+rwx,g+rwx it for the "
                    f"engine's user, or {SSD}")
        return ("MTE401", f"{msg}: its mode is {st.st_mode & 0o7777:o} (owner: this user)",
                f"chmod u+rwx {directory}, or {SSD}")
    return ("MTE401", msg, f"{SSD} that this user can write")
