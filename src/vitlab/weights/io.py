"""Reading tensor files safely: safetensors, torch files with `weights_only=True` (no pickled code),
`.npz` archives lazily (one array at a time, its size checked before decompression), and small
JSON files with a size bound; writing safetensors files with the permissions any other file gets."""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitlab.errors import VitlabError
from vitlab.weights.limits import MAX_JSON_BYTES

STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a `.safetensors` or torch file as a flat name -> tensor dict (on the CPU).

    Torch files are read with `weights_only=True`; common wrappers (`{"model": ...}`,
    `{"state_dict": ...}`, a DDP `module.` prefix) are unwrapped.
    """
    return unwrap_state_dict(load_tensor_file(path), str(path))


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, then the file mode the user's umask gives (rw-r--r-- under 022): safetensors
    writes 0600, so a model saved for a team or a container would be unreadable to everyone but its owner."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without setting it where Linux shows it (setting it is racy with threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def unreadable(path: Path, exc: OSError) -> VitlabError:
    """One line for a file the OS will not let vitlab open: a permission problem is not a damaged download."""
    if isinstance(exc, PermissionError):
        return VitlabError(f"cannot read {path}: permission denied; make it readable (chmod u+r, or ask its owner) "
                           "or copy it somewhere you can read")
    return VitlabError(f"cannot read {path} ({exc.strerror or type(exc).__name__}); check the path and the disk")


def not_regular_file(path: Path) -> VitlabError:
    """One line for a path that exists but is no regular file (a FIFO, a device such as a link to /dev/zero, a
    socket): opening a FIFO waits for a writer forever and a device never ends, so it is refused unread."""
    return VitlabError(f"{path} is not a regular file (a folder, a FIFO, a device or a socket); vitlab reads weights and "
                       "configs from regular files only: pass the file itself")


def is_regular_file(path: Path) -> bool:
    """True for a regular file, False where nothing is; anything else of that name (a folder, a FIFO, a link to a
    device) is refused in one line (`not_regular_file`) rather than reported as missing or opened."""
    if path.is_file():
        return True
    if path.exists():
        raise not_regular_file(path)
    return False


def sniff_format(path: str | Path) -> str:
    """What a weights file holds, from its first bytes rather than its name: 'safetensors' (an 8-byte
    little-endian header length, then the JSON header's '{'), 'torch' (torch.save's zip, 'PK', or a legacy
    pickle, protocol opcode 0x80), 'npz'-style zips are 'torch' too (torch.load reports them), else 'unknown'.
    A renamed file is then read as what it is, and an unreadable one is reported as such."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise not_regular_file(p)
    try:
        with open(p, "rb") as fh:
            head = fh.read(9)
    except OSError as exc:
        raise unreadable(p, exc) from exc
    if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= p.stat().st_size - 8:
        return "safetensors"
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch"
    return "unknown"


def is_npz(path: str | Path) -> bool:
    """A zip of `.npy` arrays (numpy's .npz), whatever its name; torch.save's zips hold `data.pkl` instead. Only
    the zip's directory is read."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):  # NotImplemented: a damaged zip version
        return False
    return bool(names) and all(n.endswith(".npy") for n in names)


def load_tensor_file(path: str | Path) -> Any:
    """What a `.safetensors` file (a name -> tensor dict) or a torch file (any object of tensors and plain data,
    `weights_only=True`) holds, on the CPU. The content decides which reader runs, not the suffix: both readers
    are safe on any input (no pickled code runs), so a safetensors file named `.pth` (or the reverse) loads."""
    p = Path(path)
    if not p.is_file():
        raise not_regular_file(p) if p.exists() else VitlabError(f"no such file: {p}")
    kind = sniff_format(p)
    if kind == "safetensors" or (kind == "unknown" and p.suffix == ".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(str(p), device="cpu")
        except Exception as exc:  # SafetensorsError (truncated header/data), OSError
            raise VitlabError(f"cannot read {p} as safetensors ({exc}); is the file complete?") from exc
    check_torch_zip(p)
    try:
        if p.name.endswith(".safetensors"):  # torch.load would hand a path with this name to safetensors
            with open(p, "rb") as fh:
                return torch.load(fh, map_location="cpu", weights_only=True)
        return torch.load(p, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise unreadable(p, exc) from exc
    except Exception as exc:  # truncated zip, pickle with code, not a torch file at all
        raise _torch_load_error(p, exc) from exc


def _torch_load_error(path: Path, exc: Exception) -> VitlabError:
    """One line for a torch file vitlab will not read. torch's own message goes on to advise
    `weights_only=False`, i.e. running the file's code: it is never repeated here."""
    text = str(exc)
    pickled = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if pickled:
        return VitlabError(
            f"{path} holds pickled Python objects other than tensors ({pickled.group(1)}); vitlab reads torch files "
            "with weights_only=True and never executes their code: in an environment you trust, re-save the "
            "weights as safetensors or as a plain state dict of tensors (torch.save(model.state_dict(), ...)) "
            "and load that file"
        )
    # The first sentence of the cause only: torch's advice that follows is left out.
    tail = text.split("WeightsUnpickler error:")[-1]
    first = next((line.strip() for line in tail.splitlines() if line.strip()), type(exc).__name__)
    detail = first.split(". ")[0][:160]
    return VitlabError(
        f"cannot read {path} as a PyTorch state dict ({type(exc).__name__}: {detail}); only complete torch "
        "files holding plain tensors are read (weights_only=True): is the file complete and a state dict?"
    )


def check_torch_zip(path: Path) -> None:
    """Refuse a torch zip that would load wrong: a member declaring far more bytes than the file holds (torch.save
    writes uncompressed, so that is a zip bomb or damage), or a member whose bytes fail the CRC-32 the zip records.
    torch.load checks no checksum, so a flipped byte (a disk or copy error) loaded as a silently changed weight or
    optimizer moment; the check reads the file once more, about as long as torch.load's own read."""
    try:
        if not zipfile.is_zipfile(path):  # can raise on a damaged end-of-archive record
            return
        with zipfile.ZipFile(path) as z:
            declared = sum(info.file_size for info in z.infolist())
            size = path.stat().st_size
            if declared > 2 * size + 2**20:
                raise VitlabError(f"{path} declares {declared / 2**20:.0f} MB of data in a {size / 2**20:.1f} MB "
                                  "file (torch writes its files uncompressed: a zip bomb or a damaged file); re-save "
                                  "the weights")
            damaged = z.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError):
        return  # torch.load reports the damaged archive in its own words
    if damaged is not None:
        raise VitlabError(f"{path} is damaged: its part {damaged} fails the checksum the file records (a changed "
                          "byte, from the disk or a copy); use another copy, or download or save it again")


_WRAPPERS = ("model", "state_dict", "model_state", "module")
_EMA_WRAPPERS = ("state_dict_ema", "model_ema", "ema", "ema_state_dict")


def _holds_tensors(obj: object) -> bool:
    return isinstance(obj, dict) and any(isinstance(v, torch.Tensor) for v in obj.values())


def unwrap_state_dict(obj: object, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Find the state dict inside a loaded checkpoint object: the first wrapper that holds tensors (a "model"
    entry holding only the architecture's settings is skipped), else an EMA copy when that is all there is
    (timm's train.py `state_dict_ema`, DeiT's `model_ema`); next to the raw weights the raw ones load, as timm's
    `load_checkpoint` does by default."""
    if isinstance(obj, dict):
        for key in (*_WRAPPERS, *_EMA_WRAPPERS):
            if _holds_tensors(obj.get(key)):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj:
        raise VitlabError(f"{source} holds no state dict (expected a dict of tensors)")
    out = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not out:
        raise VitlabError(f"{source} holds no tensors")
    for k, v in out.items():
        check_tensor_kind(k, v, source)
    for prefix in ("module.", "_orig_mod."):  # DistributedDataParallel, torch.compile
        if all(k.startswith(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out


# Floating-point dtypes every reader and every op vitlab runs on weights supports (fp16/bf16/fp64 are cast on load).
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor_kind(name: str, t: torch.Tensor, source: str) -> None:
    """Refuse what no reader can hold as weights, before any op runs on it (torch raises NotImplementedError or
    RuntimeError deep inside otherwise): sparse or other non-dense layouts, meta tensors (shapes without values),
    quantized tensors and the float8 dtypes. Integer tensors pass here: buffers such as `num_batches_tracked`
    are integers, and an integer where a float parameter belongs is refused by the state-dict check."""
    if t.layout != torch.strided:
        raise VitlabError(f"{source}: tensor {name!r} is stored {str(t.layout).replace('torch.', '')} (not dense); "
                          "vitlab reads dense tensors: save the weights with tensor.to_dense()")
    if t.is_meta:
        raise VitlabError(f"{source}: tensor {name!r} is a meta tensor (a shape without values, {t.dtype}); the file "
                          "holds no weights for it: save the model after its weights are loaded or initialised")
    if t.is_quantized:
        raise VitlabError(f"{source}: tensor {name!r} is quantized ({t.dtype}); vitlab reads float weights: save "
                          "the float model (tensor.dequantize())")
    if t.is_floating_point() and t.dtype not in _FLOAT_DTYPES:
        raise VitlabError(f"{source}: tensor {name!r} is {str(t.dtype).replace('torch.', '')}, a dtype vitlab does "
                          "not load (float16, bfloat16, float32 and float64 load): cast the weights to one of those "
                          "and save them again")


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a `.safetensors` header ({} for other files or none)."""
    p = Path(path)
    try:
        if sniff_format(p) != "safetensors":  # by content: a safetensors file renamed .pth keeps its record
            return {}
    except VitlabError:
        return {}  # unreadable: read_tensors reports it
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # unreadable headers are reported by read_tensors
        return {}


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a `.safetensors` file, from its header alone (nothing is read)."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_file() and sniff_format(p) == "torch":  # safetensors' own "header too large" would hide what it is
        raise VitlabError(f"{p} is a PyTorch file (torch.save), not safetensors as its name says; re-save it as "
                          "safetensors (vitlab.save writes a model folder), or rename it .pth and load that file")
    try:
        with safe_open(str(p), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # SafetensorsError (truncated header/data), OSError
        raise VitlabError(f"cannot read {p} as safetensors ({exc}); is the file complete?") from exc


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    """A small JSON file's content; refused above MAX_JSON_BYTES (a config is a few KB), and
    malformed or absurdly nested JSON is one VitlabError line."""
    p = Path(path)
    try:
        if p.exists() and not p.is_file():  # checked before the open below, which a FIFO would block
            raise not_regular_file(p)
        size = p.stat().st_size
        with open(p, "rb"):  # an unreadable file is said to be one (not a raw PermissionError)
            pass
    except OSError as exc:
        raise unreadable(p, exc) from exc
    if size > MAX_JSON_BYTES:
        raise VitlabError(f"{p} is {size / 2**20:.0f} MB, above the {MAX_JSON_BYTES // 2**20} MB a {what} may have "
                          "(docs/weights.md, Limits); is it the right file?")
    try:
        return json.loads(p.read_text())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise VitlabError(f"{p} is not valid JSON ({type(exc).__name__}: {str(exc)[:160]})") from exc


def folder_config(folder: Path) -> dict | None:
    """The folder's `config.json` as a dict, or None when it is absent or not a JSON object
    (used to tell vitlab, Hugging Face and timm folders apart)."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = read_json(cfg, "config.json")
    except VitlabError as exc:
        if "not valid JSON" in str(exc):
            return None
        raise
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------------- lazy .npz
class LazyArray:
    """An array that is read only when converted (`np.asarray`): shape and dtype come from a cheap
    `describe()`, the data from `load()`. `reshape` and integer indexing give lazy views, so code
    written for a dict of numpy arrays (normalising layouts, splitting scan-stacked blocks) runs
    unchanged on an archive without reading what it never uses."""

    def __init__(self, describe: Callable[[], tuple[tuple[int, ...], np.dtype]], load: Callable[[], np.ndarray]):
        self._describe, self._load = describe, load
        self._info: tuple[tuple[int, ...], np.dtype] | None = None
        self._array: np.ndarray | None = None

    def _header(self) -> tuple[tuple[int, ...], np.dtype]:
        if self._info is None:
            self._info = self._describe()
        return self._info

    @property
    def shape(self) -> tuple[int, ...]:
        return self._header()[0]

    @property
    def dtype(self) -> np.dtype:
        return self._header()[1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self._load()
        return array if dtype is None else array.astype(dtype, copy=False)

    def reshape(self, *shape: Any) -> LazyArray:
        new = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)

        def describe() -> tuple[tuple[int, ...], np.dtype]:
            known = math.prod(s for s in new if s != -1)
            return tuple(self.size // max(known, 1) if s == -1 else s for s in new), self.dtype

        return LazyArray(describe, lambda: np.asarray(self).reshape(new))

    def __getitem__(self, index: int) -> LazyArray:
        """Row `index` of the first axis; the whole array is read once and shared by all rows."""
        return LazyArray(lambda: (self.shape[1:], self.dtype), lambda: self._whole()[index])

    def _whole(self) -> np.ndarray:
        if self._array is None:
            self._array = np.asarray(self)
        return self._array


def is_bfloat16_bits(dtype: np.dtype) -> bool:
    """numpy has no bfloat16: JAX's (ml_dtypes') bf16 arrays, as big_vision saves them with `np.savez`, are stored
    as plain 2-byte voids (`|V2`). No other 2-byte type is saved that way (float16 has its own `<f2`)."""
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None and dtype.subdtype is None


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the upper half of a float32: widening is exact."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


class NpzArchive(Mapping):
    """An `.npz` as a mapping of name -> LazyArray, on numpy's lazy NpzFile (pickling disabled).

    Nothing is decompressed until an array is converted; then its declared (uncompressed) size
    in the zip directory must equal what its .npy header describes, and its dtype must be a float,
    before numpy allocates and decompresses it. JAX's bf16 arrays (`|V2`, is_bfloat16_bits) read as float32, as
    bf16 tensors of other formats are cast on load. Use as a context manager (closes the file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._npz = np.load(self.path, allow_pickle=False)
        except FileNotFoundError:
            raise
        except PermissionError as exc:  # not a damaged file: say so
            raise unreadable(self.path, exc) from exc
        except Exception as exc:  # zipfile.BadZipFile, ValueError, EOFError (truncated)
            raise VitlabError(f"cannot read {self.path} as an .npz checkpoint ({type(exc).__name__}: {exc}); "
                              "is the file complete?") from exc
        if not isinstance(self._npz, np.lib.npyio.NpzFile):
            raise VitlabError(f"{self.path} is a single .npy array, not an .npz checkpoint (a zip of named arrays)")
        self._members = {i.filename[:-4]: i for i in self._npz.zip.infolist() if i.filename.endswith(".npy")}
        names = Counter(i.filename for i in self._npz.zip.infolist())
        if len(names) != len(self._npz.zip.infolist()):  # zip tools disagree on which same-named member is the array
            twice = sorted(n for n, count in names.items() if count > 1)
            self._npz.close()
            raise VitlabError(f"{self.path} holds the member {twice[0]} more than once (a damaged or crafted zip: "
                              "which copy is the array is unclear); re-download or re-save the checkpoint")
        self._headers: dict[str, tuple[tuple[int, ...], np.dtype, int]] = {}
        self._fortran: set[str] = set()  # members stored in column-major order (a transposed array saved)

    def __getitem__(self, key: str) -> LazyArray:
        if key not in self._members:
            raise KeyError(key)
        return LazyArray(lambda: self._described(key), lambda: self.read(key))

    def _described(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        shape, dtype, _ = self.header(key)
        return shape, np.dtype(np.float32) if is_bfloat16_bits(dtype) else dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: object) -> bool:
        return key in self._members

    def __enter__(self) -> NpzArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._npz.close()

    def header(self, key: str) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape, dtype, data offset) from the member's .npy header; only its first bytes are decompressed."""
        if key not in self._headers:
            self._headers[key] = self._read_header(key)
        return self._headers[key]

    def _read_header(self, key: str) -> tuple[tuple[int, ...], np.dtype, int]:
        fmt = np.lib.format
        try:
            with self._npz.zip.open(self._members[key]) as f:
                version = fmt.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = fmt.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = fmt.read_array_header_2_0(f)
                else:
                    raise ValueError(f"unsupported .npy format version {version}")
                offset = f.tell()
                if fortran:
                    self._fortran.add(key)
        except Exception as exc:  # a bad header, a damaged member
            raise VitlabError(f"cannot read the array {key!r} of {self.path} ({type(exc).__name__}: {exc}); "
                              "is the file complete?") from exc
        if dtype.hasobject:
            raise VitlabError(f"{self.path}: array {key!r} holds pickled Python objects; vitlab reads plain numeric "
                              "arrays only: re-save the checkpoint with numpy arrays of floats")
        return tuple(int(n) for n in shape), dtype, offset

    def read(self, key: str) -> np.ndarray:
        """The array, after checking its dtype and its declared size against its header."""
        shape, dtype, offset = self.header(key)
        bf16 = is_bfloat16_bits(dtype)
        if dtype.kind != "f" and not bf16:
            raise VitlabError(f"{self.path}: array {key!r} is {dtype}, not floating point; a weights file holds "
                              "float arrays: re-export the weights as floats")
        declared, described = self._members[key].file_size, offset + math.prod(shape) * dtype.itemsize
        if declared != described:
            raise VitlabError(
                f"{self.path}: array {key!r} declares {declared} uncompressed bytes but its header describes "
                f"{described} ({shape} {dtype}); the file is damaged or crafted (a zip bomb?): re-download or re-save it"
            )
        try:
            array = self._read_stored(key, shape, dtype, offset)
            if array is None:
                array = self._npz[key]
            if not array.dtype.isnative:  # big-endian floats (saved on such a machine): torch takes native order only
                array = array.astype(array.dtype.newbyteorder("="))
            return bfloat16_bits_to_float32(array) if bf16 else array
        except Exception as exc:  # truncated data, CRC error
            raise VitlabError(f"cannot read the array {key!r} of {self.path} ({type(exc).__name__}: {exc}); "
                              "is the file complete?") from exc

    def _read_stored(self, key: str, shape: tuple[int, ...], dtype: np.dtype, offset: int) -> np.ndarray | None:
        """An uncompressed member (what `np.savez` and the official checkpoints write) read in one call into its
        array, with the zip's CRC checked, instead of numpy's reads of 256 KiB through zipfile (which took most of
        an .npz load). None where numpy's path is needed: a compressed or encrypted member."""
        info = self._members[key]
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.compress_size != info.file_size:
            return None
        import struct
        import zlib

        fp = self._npz.zip.fp
        fp.seek(info.header_offset)
        local = fp.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise ValueError("bad local file header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > os.fstat(fp.fileno()).st_size:  # before allocating what the file cannot hold
            raise EOFError("the member runs past the end of the file")
        fp.seek(start)
        head = fp.read(offset)
        fortran = key in self._fortran
        array = np.empty(shape, dtype, order="F" if fortran else "C")
        data = memoryview((array.T if fortran else array).reshape(-1).view(np.uint8))  # the array's own memory
        if len(head) != offset or fp.readinto(data) != len(data):
            raise EOFError("the member is shorter than its size")
        if zlib.crc32(data, zlib.crc32(head)) != info.CRC:
            raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")  # zipfile's own words
        return array
