"""One downloader for weights and data: a cache folder, `.part` files resumed with HTTP Range, size and
SHA-256 checks, `VITLAB_OFFLINE=1` for cache-only use, and one-line errors that say what to fetch by hand.

Written on urllib (stdlib) because the needs are small and no new dependency is wanted; huggingface_hub
keeps handling `hf:` ids (it has its own cache and `HF_HUB_OFFLINE`).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from pathlib import Path

from vitlab.errors import VitlabError
from vitlab.progress import bar_options

CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where downloaded weights go: $VITLAB_CACHE, else ~/.cache/vitlab."""
    return Path(os.environ.get("VITLAB_CACHE") or Path.home() / ".cache" / "vitlab").expanduser()


def offline() -> bool:
    """True when VITLAB_OFFLINE is set to 1/true/yes: only the cache is used, the network never touched."""
    return os.environ.get("VITLAB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def sha256sum(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def md5sum(path: str | os.PathLike) -> str:
    """The hex MD5 of a file (the data sets' published checksums are MD5)."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _digest_problem(path: Path, size: int | None, sha256: str | None, md5: str | None) -> str | None:
    """What is wrong with a complete file against its published size/hashes, or None."""
    got = path.stat().st_size
    if size is not None and got != size:
        return f"{got:,} bytes instead of {size:,}"
    if sha256 and (digest := sha256sum(path)) != sha256.lower():
        return f"SHA-256 {digest[:16]}... instead of {sha256[:16]}..."
    if md5 and (digest := md5sum(path)) != md5.lower():
        return f"MD5 {digest} instead of {md5}"
    return None


def fetch(
    url: str,
    target: str | os.PathLike,
    *,
    size: int | None = None,
    sha256: str | None = None,
    md5: str | None = None,
    progress: bool = True,
    timeout: float = 30.0,
    attempts: int = 3,
) -> Path:
    """`target`, downloading `url` to it first unless it is there; a partial `.part` file is resumed.

    A cached file is trusted when its size fits (hashes are checked once, on download: hashing a 2 GiB
    checkpoint on every load would cost seconds). A downloaded file that fails its size or hash is removed
    and the error says so. With VITLAB_OFFLINE=1 a missing file is an error naming the URL and the path.
    """
    target = Path(target)
    if target.is_file() and (size is None or target.stat().st_size == size):
        return target
    if offline():
        raise VitlabError(f"VITLAB_OFFLINE=1 and {target.name} is not in the cache: download {url} by hand and put "
                          f"it at {target} (or unset VITLAB_OFFLINE)")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    last: BaseException | None = None
    for _ in range(max(1, attempts)):
        try:
            _download(url, part, progress, timeout)
            last = None
            break
        except _Incomplete as exc:  # a cut connection: resume from what arrived
            last = exc
        except urllib.error.HTTPError as exc:
            last = exc
            if exc.code != 416:  # 404, 403, ...: trying again will not help (416: the .part was reset)
                break
        except (OSError, http.client.HTTPException) as exc:  # no network, refused, DNS, timeout
            last = exc
            break
    if last is not None:
        raise _failed(url, target, part, last)
    if problem := _digest_problem(part, size, sha256, md5):
        part.unlink(missing_ok=True)
        raise VitlabError(f"{url} arrived corrupted ({problem}); removed {part}: run the command again to "
                          f"re-download, or fetch it by hand and put it at {target}")
    os.replace(part, target)
    return target


class _Incomplete(Exception):
    """The connection ended before Content-Length bytes arrived (the `.part` file is kept for resuming)."""


def _failed(url: str, target: Path, part: Path, exc: BaseException | None) -> VitlabError:
    have = part.stat().st_size if part.is_file() else 0
    reason = getattr(exc, "reason", None) or exc or "unknown error"
    if isinstance(exc, urllib.error.HTTPError):
        reason = f"HTTP {exc.code} {exc.reason}"
    kept = f"; {have:,} bytes kept in {part}, the next run resumes" if have else ""
    return VitlabError(f"cannot download {url} ({reason}){kept}; without a network download it elsewhere and put it "
                       f"at {target}")


def _download(url: str, part: Path, progress: bool, timeout: float) -> None:
    """Append the rest of `url` to `part` (Range from its current size); raise _Incomplete on a cut."""
    have = part.stat().st_size if part.is_file() else 0
    headers = {"User-Agent": "vitlab"}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the range starts at or past the end: begin again from zero
            part.unlink()
        raise
    with response:
        resumed = have and response.status == 206
        if not resumed:
            have = 0  # the server ignored the Range header: start over
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        _copy(response, part, "ab" if resumed else "wb", have, total, progress)
    if total is not None and part.stat().st_size < total:
        raise _Incomplete(f"connection closed after {part.stat().st_size:,} of {total:,} bytes")


def _copy(response, part: Path, mode: str, have: int, total: int | None, progress: bool) -> None:
    from tqdm.auto import tqdm

    with open(part, mode) as out, tqdm(total=total, initial=have, unit="B", unit_scale=True, leave=False,
                                       desc=part.name.removesuffix(".part"), disable=not progress,
                                       **bar_options()) as bar:
        while True:
            try:
                block = response.read(CHUNK)
            except (TimeoutError, http.client.IncompleteRead, ConnectionError) as exc:
                raise _Incomplete(f"connection lost after {out.tell():,} bytes ({type(exc).__name__})") from exc
            if not block:
                break
            out.write(block)
            bar.update(len(block))
