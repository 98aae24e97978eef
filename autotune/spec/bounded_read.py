"""Reading a file a user named, safely: the spec and a serving workload's lengths file.

One reader for both, because the same care applies to each: opened without blocking (a FIFO swapped
in after a check never hangs the CLI) and without a controlling terminal, checked to be a regular file
on the open descriptor (not the path), and read with a bound, so a huge or endless file is refused
rather than read into memory.
"""

from __future__ import annotations

import os
import stat

__all__ = ["NotRegularFile", "read_bounded"]

_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class NotRegularFile(OSError):
    """The path opened to something other than a regular file; ``mode`` says what."""

    def __init__(self, mode: int):
        super().__init__("not a regular file")
        self.mode = mode


def read_bounded(path: os.PathLike | str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file at ``path`` (more than ``limit`` means it is
    too large); ``OSError`` when it cannot be opened or read, :class:`NotRegularFile` when it is a
    directory, a device, a FIFO or a socket."""
    fd = os.open(path, _FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(info.st_mode)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
