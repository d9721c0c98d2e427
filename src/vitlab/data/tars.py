"""Opening tar archives (CIFAR's .tar.gz, tar shards, downloads) with their extended headers bounded.

The standard library's `tarfile` reads a GNU long-name/long-link header or a pax header whole into memory
before a caller sees any member: a header declaring 4 GB is 4 GB of RAM, from a 4 MB `.tar.gz` (gzip expands
zeros 1000:1) or from any large shard. Real ones hold a path or a few key=value records (well under 64 KiB).
"""

from __future__ import annotations

import os
import tarfile

MAX_TAR_HEADER_BYTES = 2**20  # one extended header (long name, long link, pax records)

_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)


class TarHeaderTooLarge(tarfile.TarError):
    """An extended tar header larger than MAX_TAR_HEADER_BYTES (a TarError, so readers report it as a damaged
    archive; not a ReadError, which `tarfile.open("r:*")` would swallow while trying other compressions)."""


class BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses an oversized extended header before tarfile reads it (the headers chained after
    it are read with this class too)."""

    def _proc_member(self, tarfile_):  # tarfile's hook for every header read, before its payload is read
        if self.type in _EXTENDED and self.size > MAX_TAR_HEADER_BYTES:
            raise TarHeaderTooLarge(f"a tar header of {self.size:,} bytes at byte {self.offset}, over the "
                                    f"{MAX_TAR_HEADER_BYTES:,} any real one needs")
        return super()._proc_member(tarfile_)


def open_tar(path: str | os.PathLike, mode: str = "r:*") -> tarfile.TarFile:
    """`tarfile.open(path, mode)` for reading, with extended headers bounded (BoundedTarInfo)."""
    return tarfile.open(path, mode, tarinfo=BoundedTarInfo)
