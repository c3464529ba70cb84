"""Opening files that another user controls, from a daemon that may run as root (Linux).

The rule (docs/security.md): the daemon never opens, as root, a path that a user can replace. A task's run
directory belongs to the task's user, who may put a symbolic link, a FIFO, a device's hard link or a
directory where a log or record file was. Opening such a name with plain `open` follows the link (and
prints another user's file, or `/etc/shadow`, to whoever asks for the log), blocks on the FIFO until a
writer comes (the whole daemon with it), or opens a device (with whatever opening it does).

So every such file is first opened with `O_PATH | O_NOFOLLOW`, which reads nothing and opens no device,
checked with `fstat` (a regular file, owned by the directory's owner or the daemon, and for contents shown
to users or appended to, no other hard link), and only then reopened for reading or appending through
`/proc/self/fd`, which reaches that very inode whatever the name points to by then.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection
from functools import cache
from pathlib import Path
from typing import BinaryIO

_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


KERNEL_FILES = ("/proc/", "/sys/")  # where a regular file may block, or change the system when read

MACHINE_FAULTS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT})
"""Errors of the machine (descriptors, memory, space), not of a file or a task: a caller tries again later."""


class UnsafeFile(OSError):
    """A file the daemon refuses to open: not a plain file of the run dir's owner. Its message is one line."""


def open_for_reading(path: Path, owners: Collection[int] | None = None, single_link: bool = True) -> BinaryIO:
    """`path` opened for reading, refused (UnsafeFile) unless it is a regular file reached without following a
    symbolic link at its last component, owned by one of `owners` (any owner when None) and, when
    `single_link`, with no other hard link, and not in the kernel's own file systems (`/proc/kmsg` is a
    regular file whose read waits for the kernel's next message, and takes it from the system log; tracefs's
    `trace_pipe` too): by its path, and by the file system of what was opened. Read without blocking all the
    same. Missing: FileNotFoundError, as `open` says."""
    if _kernel_path(path):
        raise UnsafeFile(f"{path} is a file of the kernel's: carma reads no file there")
    if not hasattr(os, "O_PATH"):  # not Linux (`carma estimate` on a laptop): checked once opened, unblocked
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        return os.fdopen(_checked(fd, path, owners, single_link), "rb")
    fd = _checked(os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC), path, owners, single_link)
    if os.fstat(fd).st_dev in _kernel_devices():  # reached through a folder swapped since the path was read
        os.close(fd)
        raise UnsafeFile(f"{path} is a file of the kernel's: carma reads no file there")
    try:
        return os.fdopen(_reopen(fd, os.O_RDONLY | os.O_NONBLOCK), "rb")
    finally:
        os.close(fd)


def _kernel_path(path: Path) -> bool:
    """Whether `path` names a file in the kernel's file systems: its folder resolved, its own name not (it is
    opened without following a link, and a user's link there is refused as one). A folder reached through a
    chain of links too long to resolve is refused: Python resolves each link by recursing, and a user's chain
    of 1,500 links raised RecursionError (which stopped the daemon at each start while the task's log was one)."""
    try:
        folder = os.path.realpath(path.parent)
    except (RecursionError, ValueError):
        raise UnsafeFile(f"{path}: its folder is reached through too many symbolic links") from None
    return os.path.join(folder, path.name).startswith(KERNEL_FILES)


@cache
def _kernel_devices() -> frozenset[int]:
    """The devices of the kernel's file systems mounted where Linux mounts them."""
    found = set()
    for place in ("/proc", "/sys", "/sys/kernel/tracing", "/sys/kernel/debug", "/sys/kernel/debug/tracing"):
        try:
            found.add(os.stat(place).st_dev)
        except OSError:
            continue
    return frozenset(found)


def open_for_append(path: Path, owners: Collection[int] | None = None, mode: int = 0o644) -> BinaryIO:
    """`path` opened for appending, created (`mode`) if missing; an existing one is checked as in
    `open_for_reading` (a single link: appending to a hard link of `/etc/passwd` would change it). Opened
    without blocking: the owner's lease on the file (`F_SETLEASE`) would hold the open until the kernel's
    lease-break time (45 s) ran out; it fails at once (BlockingIOError) instead."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        path_fd = _checked(os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC), path, owners, single_link=True)
        try:
            fd = _reopen(path_fd, flags)
        finally:
            os.close(path_fd)
    return os.fdopen(fd, "ab")


def hand_to_owner(fd: int, directory: Path) -> None:
    """As root, give a file just made in a user's `directory` to that directory's owner, on its descriptor (never
    by name): the user's own reader of it (the shim, `owners_of`) trusts their files only."""
    owner = os.lstat(directory)
    if os.geteuid() == 0 and owner.st_uid != 0:
        os.fchown(fd, owner.st_uid, owner.st_gid)


def owners_of(directory: Path) -> set[int]:
    """Who may own the files of `directory`: its owner only (a task's run dir belongs to the task's user, and a
    root daemon gives the user each file it makes there). Not root besides: a user may move into their run dir
    any file of root's from a folder they can write, which root would then show as their log. The directory
    itself must not be replaceable by a user: its parent is the daemon's."""
    return {os.lstat(directory).st_uid}


def _checked(fd: int, path: Path, owners: Collection[int] | None, single_link: bool) -> int:
    """`fd`, or UnsafeFile (and `fd` closed) when what it opened is not a plain file as the caller asks."""
    try:
        info = os.fstat(fd)
        problem = _problem(info, owners, single_link)
        if problem:
            raise UnsafeFile(f"{path} {problem}: carma opens only the plain files it made there")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _problem(info: os.stat_result, owners: Collection[int] | None, single_link: bool) -> str | None:
    kind = stat.S_IFMT(info.st_mode)
    if kind != stat.S_IFREG:
        return f"is {_KINDS.get(kind, 'not a regular file')}"
    if owners is not None and info.st_uid not in owners:
        return f"belongs to uid {info.st_uid}, not to the task's user"
    if single_link and info.st_nlink != 1:
        return f"has {info.st_nlink} hard links"
    return None


def _reopen(path_fd: int, flags: int) -> int:
    """Open the inode `path_fd` refers to (an `O_PATH` descriptor already checked) with `flags`."""
    return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC | os.O_NOCTTY)
