"""Files of a simulated sysfs tree: attribute values shared through hard links, the count files written in
place, links, and removal.

Attribute files are hard links to one file per value under the tree's values directory (`attr`): a host has
thousands of attribute files but a few hundred values, and on a loaded ext4 a new inode costs up to a
millisecond where a link costs ~25 us. Nothing writes a shared file in place: a new value is linked over the
old name (rename(2), so a reader sees the old value or the new one), and the count files the emulator
rewrites on every create and remove get a private inode on their first change and are then written in place
(`update`, `update_changed`).
"""

from __future__ import annotations

import os
from pathlib import Path


def write(path: Path | str, content: str) -> None:
    """Create or overwrite a file with `content`: open(2) with O_TRUNC, one write(2), close(2), as
    open(path, "w") would do, without the text layer's fstat, ioctl and lseek."""
    _write_bytes(path, content.encode(), 0o666)


def _write_bytes(path: Path | str, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, _NEW, mode)
    except FileNotFoundError:  # first file of a new directory: make it only then (keeps `sim create` fast)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, _NEW, mode)
    try:
        if data:
            os.write(fd, data)
    finally:
        os.close(fd)


_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def update(path: Path | str, content: str) -> None:
    """Rewrite an existing attribute file only when its value changes (for callers that do not know what
    it holds: one open and one read when unchanged)."""
    data = content.encode()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if os.read(fd, len(data) + 1) == data:
            return
        if os.fstat(fd).st_nlink > 1:  # a shared value: never written in place
            _replace_private(path, data)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def update_changed(old: dict[str, str], new: dict[str, str]) -> None:
    """Rewrite the files whose value goes from `old` (what they hold, as the caller knows from the state they
    were derived from) to `new`. A value of the same length is overwritten in place without truncating, so a
    concurrent reader never sees the file empty (as sysfs, whose reads never see half a value); a file that
    still shares its value with others gets its own inode first (once: afterwards it is written in place)."""
    for path, content in new.items():
        before = old.get(path)
        if before == content:
            continue
        data = content.encode()
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_nlink > 1:
                _replace_private(path, data)
                continue
            if before is None or len(before.encode()) != len(data):
                os.ftruncate(fd, 0)
            os.write(fd, data)
        finally:
            os.close(fd)


def _replace_private(path: Path | str, data: bytes) -> None:
    """Put a file of its own with `data` in place of `path` (a shared value), atomically."""
    tmp = f"{path}.~sim-new"
    fd = os.open(tmp, _NEW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def read_text(path: str) -> str:
    """A small attribute file's content: open, read, close (Path.read_text adds fstat, ioctl, lseek)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 4096)]
        while len(chunks[-1]) == 4096:
            chunks.append(os.read(fd, 4096))
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def link(path: Path | str, target: Path | str) -> None:
    """A relative symlink, as sysfs has them (replacing one that is there)."""
    rel = os.path.relpath(target, os.path.dirname(path))
    try:
        os.symlink(rel, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(rel, path)
    except FileExistsError:
        if not os.path.islink(path):
            raise
        if os.readlink(path) == rel:
            return
        os.unlink(path)
        os.symlink(rel, path)


def attr(values: str, path: Path | str, content: str) -> None:
    """Create or replace the attribute file `path` with `content`, as a hard link to the file holding that
    value under the directory `values` (made on first use); a file already there is replaced atomically,
    never written."""
    data = content.encode()
    value = f"{values}/{value_name(data)}"
    target = os.fspath(path)
    for _ in range(3):  # at most: make the value, make the directory, link
        try:
            os.link(value, target)
            return
        except FileExistsError:
            if target.endswith(".~sim-new"):  # left by a writer that died between link and rename
                os.unlink(target)
                continue
            try:
                if os.lstat(target).st_ino == os.stat(value).st_ino:
                    return  # already this value (a directory moved back, or an unchanged write)
            except FileNotFoundError:
                pass
            attr(values, f"{target}.~sim-new", content)
            os.rename(f"{target}.~sim-new", target)
            return
        except FileNotFoundError:
            if not os.path.exists(value):
                make_value(value, data)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
    os.link(value, target)


def value_name(data: bytes) -> str:
    """The file name of a value: its bytes in hex when short, else a digest of them."""
    if len(data) <= 48:
        return "h" + data.hex()
    import hashlib

    return "s" + hashlib.sha256(data).hexdigest()


def make_value(value: str, data: bytes) -> None:
    """Write a value file under a private name and link it into place, so no reader ever links or reads
    half of one; a value another process made meanwhile is the same bytes."""
    tmp = f"{value}.{os.getpid()}.tmp"
    _write_bytes(tmp, data, 0o644)
    try:
        os.link(tmp, value)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def entries(top: str) -> set[str]:
    """Every entry under `top` (files, links, directories), as paths relative to it; links not followed."""
    out: set[str] = set()
    for d, dirs, files in os.walk(top):
        rel = os.path.relpath(d, top)
        out.update(n if rel == "." else f"{rel}/{n}" for n in dirs + files)
    return out


def mkdir_quiet(path: str) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_dir(path: str, subdirs: tuple[str, ...]) -> None:
    """rmdir the (expected empty) subdirectories and then `path`; whatever else is in them goes as _rmtree."""
    try:
        for sub in subdirs:
            try:
                os.rmdir(f"{path}/{sub}")
            except FileNotFoundError:
                pass
        os.rmdir(path)
    except OSError:
        rmtree(path)


def rmtree(p: Path | str) -> None:
    """Remove a file, link or directory tree (without following links); nothing if it is not there."""
    try:
        os.unlink(p)
        return
    except FileNotFoundError:
        return
    except (IsADirectoryError, PermissionError):  # a directory (EISDIR on Linux, EPERM elsewhere)
        pass
    for e in os.scandir(p):
        if e.is_dir(follow_symlinks=False):
            rmtree(e.path)
        else:
            os.unlink(e.path)
    os.rmdir(p)


