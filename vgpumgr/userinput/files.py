"""Reading and writing the files a user names.

Reading: only a regular file unless the caller allows more; a symbolic link is followed only where it stays in
the directory the path names (a link to `/etc/shadow` is refused); the file is opened O_NONBLOCK (a FIFO with no
writer never blocks) and its size checked before anything is read, and never more than the cap is read (`/dev/zero`
cannot fill memory). Writing: into a temporary file in the directory asked for, renamed over the target once
complete; on any failure the temporary file and SQLite's companions of it are removed, so nothing else is left.
Every OSError becomes a refusal that names the path and what the errno means (vgpumgr.errors, never exit 70)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from vgpumgr.errors import Conflict, InvalidInput, NotFound, PermissionDenied, VgpuError

NAME_MAX = 255
KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
         stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link",
         stat.S_IFREG: "a regular file"}
_COMPANIONS = ("-wal", "-shm", "-journal")  # what SQLite may make beside a database file


def kind(mode: int) -> str:
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def refusal(exc: OSError, path: object, verb: str, hint: str | None = None) -> VgpuError:
    """An OSError on a user's path as an error a person can act on: exit 3 (missing), 5 (permission), else 2."""
    code = exc.errno or 0
    meaning = os.strerror(code) if code else str(exc)
    name = errno.errorcode.get(code, str(code))
    message = f"cannot {verb} {_shown(path)}: {meaning} ({name})"
    if code in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(message, hint=hint or "check the path", errno=name)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(message, hint=hint or "name a path this user may use (root ignores file modes, "
                                                       "not read-only mounts)", errno=name)
    return InvalidInput(message, hint=hint or "name another path", errno=name)


def _shown(path: object) -> str:
    text = str(path)
    text = text if len(text) <= 200 else text[:100] + "..." + text[-60:]
    return repr(text) if any(ord(c) < 32 or c == "\x7f" for c in text) else text


def checked_path(name: str | os.PathLike[str], what: str) -> Path:
    """A path a user typed, refused when it cannot name a file at all (empty, a NUL, a component too long)."""
    text = os.fspath(name)
    if not text:
        raise InvalidInput(f"{what}: an empty path names no file", hint="give the file's path")
    if "\0" in text:
        raise InvalidInput(f"{what}: the path {_shown(text)} holds a NUL character", hint="give the file's path")
    path = Path(text)
    if any(len(part.encode(errors="surrogateescape")) > NAME_MAX for part in path.parts):
        raise InvalidInput(f"{what}: a name in {_shown(text)} is longer than {NAME_MAX} bytes",
                           hint="give a shorter name")
    return path


def is_dir(path: Path, what: str) -> bool:
    """Whether `path` is a directory (following links: a root or state directory may be one); False when it does
    not exist, a refusal for any other error (a name too long, a component that is a file is just False)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise refusal(exc, path, f"use {what}") from None


def text_option(value: str, what: str, limit: int = 4096) -> str:
    """A global option's text (a URL, a URI): no control character, not absurdly long."""
    if len(value) > limit or any(ord(c) < 32 or c == "\x7f" for c in value):
        raise InvalidInput(f"{what} {_shown(value)} holds control characters or is longer than {limit}",
                           hint=f"give a valid {what.lstrip('-')}")
    return value


def regular(name: str | os.PathLike[str], what: str, hint: str | None = None) -> Path:
    """The path of the regular file `name`, checked by the reading rule without reading it (for a reader that
    is not ours, SQLite's)."""
    path = _inside(checked_path(name, what))
    try:
        st = os.stat(path)
    except OSError as exc:
        raise refusal(exc, path, "read", hint) from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{what}: {_shown(path)} is {kind(st.st_mode)}, not a regular file",
                           hint=hint or "name a regular file")
    return path


def _inside(path: Path) -> Path:
    """The file `path` names, following a symbolic link only where it stays in the directory path names."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise refusal(exc, path, "read") from None
    if not stat.S_ISLNK(st.st_mode):
        return path
    try:
        target = path.resolve(strict=True)
        home = path.parent.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise InvalidInput(f"{_shown(path)} is a symbolic link that leads nowhere readable ({exc})",
                           hint="name the file itself") from None
    if target.parent != home and home not in target.parents:
        raise InvalidInput(f"{_shown(path)} is a symbolic link out of its directory (to {_shown(target)}); "
                           "vgpumgr does not follow it", hint="name the file itself")
    return target


def read(name: str | os.PathLike[str], *, what: str, limit: int, hint: str | None = None) -> bytes:
    """The bytes of the regular file `name` (at most `limit` of them, else refused), by the rules above."""
    path = _inside(checked_path(name, what))
    try:
        before = os.stat(path)
    except OSError as exc:
        raise refusal(exc, path, "read", hint) from None
    if not stat.S_ISREG(before.st_mode):
        raise InvalidInput(f"{what}: {_shown(path)} is {kind(before.st_mode)}, not a regular file",
                           hint=hint or "name a regular file")
    if before.st_size > limit:
        raise InvalidInput(f"{what}: {_shown(path)} has {before.st_size} bytes, more than the {limit} it may have",
                           hint=hint or "name the right file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise refusal(exc, path, "read", hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            raise InvalidInput(f"{what}: {_shown(path)} is {kind(st.st_mode)}, not a regular file",
                               hint=hint or "name a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise refusal(exc, path, "read", hint) from None
    finally:
        os.close(fd)
    if size > limit:
        raise InvalidInput(f"{what}: {_shown(path)} has more than the {limit} bytes it may have",
                           hint=hint or "name the right file")
    return b"".join(chunks)


def target(name: str | os.PathLike[str], what: str, replace: bool) -> Path:
    """`name` made absolute, if vgpumgr may write it: a new file or (with `replace`) a regular one, in a directory."""
    path = checked_path(name, what).absolute()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise refusal(exc, path, "write") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{what}: {_shown(path)} is {kind(st.st_mode)}; vgpumgr writes only regular files",
                           hint="name a new file, or a regular file to replace")
    if st is not None and not replace:
        raise Conflict(f"{_shown(path)} exists", hint="name a new file, or add --force to replace it")
    try:
        parent = os.stat(path.parent)
    except OSError as exc:
        raise refusal(exc, path.parent, "write into", "create the directory, or name another file") from None
    if not stat.S_ISDIR(parent.st_mode):
        raise InvalidInput(f"{what}: {_shown(path.parent)} is {kind(parent.st_mode)}, not a directory",
                           hint="name a file in a directory")
    return path


def _remove(tmp: Path) -> None:
    for suffix in ("", *_COMPANIONS):
        with contextlib.suppress(OSError):
            os.unlink(f"{tmp}{suffix}")


@contextlib.contextmanager
def atomic_target(name: str | os.PathLike[str], *, what: str, replace: bool = False,
                  mode: int = 0o600) -> Iterator[Path]:
    """A temporary file (`mode`, empty) in the directory of `name` to fill; renamed to `name` when the block ends
    without an exception, removed (with any SQLite companions) when it raises. Yields the temporary path; the
    final path is `name` made absolute."""
    path = target(name, what, replace)
    tmp = path.with_name(f".vgpumgr-{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        os.fchmod(fd, mode)
        os.close(fd)
    except OSError as exc:
        raise refusal(exc, path, "write") from None
    try:
        yield tmp
        target(path, what, replace)  # nothing has appeared there meanwhile that must not be replaced
        os.replace(tmp, path)
    except OSError as exc:
        raise refusal(exc, path, "write") from None
    finally:
        _remove(tmp)


def write(name: str | os.PathLike[str], data: bytes, *, what: str, replace: bool = True, mode: int = 0o644) -> Path:
    """`data` written to `name` atomically (see atomic_target), flushed to disk before the rename."""
    with atomic_target(name, what=what, replace=replace, mode=mode) as tmp:
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise refusal(exc, name, "write") from None
    return Path(name).absolute()
