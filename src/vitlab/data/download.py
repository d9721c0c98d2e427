"""Where standard data sets live on disk, and the real download code (public addresses + MD5) for them.

Nothing is downloaded implicitly: `vitlab data download NAME` (or `download(name)`) fetches and checks
the files; without a network the error says what to fetch and where to put it. The transfer itself is
`vitlab.weights.download.fetch` (resumed `.part` files, checksums, VITLAB_OFFLINE=1), shared with the weights;
VITLAB_DATA_URL replaces the mirrors with one base URL (a local mirror, the tests' server).
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

from vitlab.data.tars import open_tar
from vitlab.errors import VitlabError

# name -> mirrors (tried in order) and {file name: MD5 of the published file}.
RESOURCES: dict[str, dict] = {
    "fashion-mnist": {
        "mirrors": [
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ],
        "files": {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        "apt": "apt-get install dataset-fashion-mnist",
    },
    "mnist": {
        "mirrors": [
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ],
        "files": {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    },
    "cifar10": {
        "mirrors": ["https://www.cs.toronto.edu/~kriz/"],
        "files": {"cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530"},
        "extract": True,
    },
    "cifar100": {
        "mirrors": ["https://www.cs.toronto.edu/~kriz/"],
        "files": {"cifar-100-binary.tar.gz": "03b5dce01913d631647c71ecec9e9cb8"},
        "extract": True,
    },
}

# Where Debian's `dataset-*` packages install data sets.
SYSTEM_DIR = Path("/usr/share/datasets")


def data_home() -> Path:
    """Root for downloaded data: $VITLAB_DATA, else ~/.cache/vitlab/datasets."""
    env = os.environ.get("VITLAB_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vitlab" / "datasets"


def search_dirs(name: str) -> list[Path]:
    """Folders searched, in order, for a named data set."""
    return [data_home() / name, SYSTEM_DIR / name]


def md5sum(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The hex MD5 of a file (the published checksums of these data sets are MD5)."""
    from vitlab.weights.download import md5sum as _md5

    return _md5(path)


def mirrors(name: str) -> list[str]:
    """The base URLs tried for a data set: $VITLAB_DATA_URL/NAME/ alone when set, else the public mirrors."""
    if base := os.environ.get("VITLAB_DATA_URL"):
        return [f"{base.rstrip('/')}/{name}/"]
    return list(RESOURCES[name]["mirrors"])


def missing_message(name: str, searched: list[Path] | None = None) -> str:
    """One line: what was searched, the command that downloads it, and the manual alternative."""
    res = RESOURCES[name]
    searched = searched or search_dirs(name)
    files = ", ".join(res["files"])
    where = ", ".join(str(p) for p in searched)
    apt = f" or `{res['apt']}`" if "apt" in res else ""
    return (f"{name} not found (searched {where}); run `vitlab data download {name}` (needs a network){apt}, "
            f"or download {files} from {res['mirrors'][0]} into {searched[0]} and pass {name}:{searched[0]}")


def _safe_target(member: tarfile.TarInfo, dest: Path, archive: Path) -> Path:
    """Where a member goes under `dest` (resolved); an absolute path or one climbing out with '..' is refused.
    `.` and `./x` members (an archive made with `tar -C DIR .`) stay inside."""
    target = (dest / member.name).resolve()
    if member.name.startswith(("/", "\\")) or (target != dest and not str(target).startswith(str(dest) + os.sep)):
        raise VitlabError(f"unsafe path {member.name!r} in {archive}; the archive is not the official one")
    return target


def _extracted(archive: Path, dest: Path) -> bool:
    """Whether every regular file of the archive is already in `dest` at its size (an extraction that was
    interrupted, or files deleted since, are extracted again)."""
    real = dest.resolve()
    try:
        with open_tar(archive) as tar:  # extended headers bounded (vitlab.data.tars)
            for member in tar:
                if member.isreg():
                    target = _safe_target(member, real, archive)
                    if not target.is_file() or target.stat().st_size != member.size:
                        return False
    except (OSError, EOFError, tarfile.TarError) as exc:  # e.g. a member name too long for the file system
        raise _bad_archive(archive, exc) from None
    return True


def _safe_extract(archive: Path, dest: Path) -> None:
    """Extract regular files and folders only, refusing absolute paths and '..' (no tar path traversal)."""
    real = dest.resolve()
    try:
        with open_tar(archive) as tar:
            for member in tar:
                if not member.isreg() and not member.isdir():
                    continue
                target = _safe_target(member, real, archive)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (EOFError, tarfile.TarError) as exc:  # OSError here is the destination's (disk full): left as it is
        raise _bad_archive(archive, exc) from None


def _bad_archive(archive: Path, exc: BaseException) -> VitlabError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return VitlabError(f"cannot extract {archive} ({text}); the archive is damaged or not the official one: "
                       "delete it and download it again")


def _fetch(name: str, fname: str, md5: str, dest: Path, progress: bool, timeout: float) -> Path:
    """DEST/FNAME with the right MD5: kept when already there, else fetched from the first mirror that works."""
    from vitlab.weights.download import fetch, offline

    target = dest / fname
    if target.exists():
        if md5sum(target) == md5:
            return target
        target.unlink()  # damaged or a different file: fetch it again
    errors = []
    for mirror in mirrors(name):
        try:
            fetch(mirror + fname, target, md5=md5, progress=progress, timeout=timeout)
            return target
        except VitlabError as exc:
            # each mirror's reason, without the per-file advice fetch() appends: said once below, for every file
            errors.append(str(exc).split("; without a network")[0])
            if offline():
                raise
    files = list(RESOURCES[name]["files"])
    listed = files[0] if len(files) == 1 else f"its {len(files)} files ({', '.join(files)})"
    raise VitlabError(f"could not download {fname} ({'; '.join(errors)}); without a network, copy "
                      f"{listed} from {mirrors(name)[0]} into {dest} and run the command again")


def download(name: str, root: str | os.PathLike | None = None, progress: bool = True, timeout: float = 30.0) -> Path:
    """Download a named data set into `root` (default data_home()/name), check MD5s, extract archives.

    A file already there with the right MD5 is kept; an interrupted download resumes from its `.part` file;
    an archive is extracted again whenever one of its files is missing or has the wrong size."""
    if name not in RESOURCES:
        raise VitlabError(f"no download known for {name!r}; choose one of {', '.join(RESOURCES)}")
    res = RESOURCES[name]
    dest = Path(root) if root else data_home() / name
    dest.mkdir(parents=True, exist_ok=True)
    for fname, md5 in res["files"].items():
        target = _fetch(name, fname, md5, dest, progress, timeout)
        if res.get("extract") and not _extracted(target, dest):
            _safe_extract(target, dest)
    return dest
