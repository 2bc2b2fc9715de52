"""A persistent cache of planning captures: `autopar plan` run again on the same model (other
clusters, batches or constraints) loads the OpGraph instead of tracing the model again.

An entry is found by a key over everything the request names: the model (a registry spec's
canonical name and config, or the whole module tree of an nn.Module: classes, parameter and
buffer shapes and dtypes, plain attributes, hooks), the loss function, the example inputs' and
targets' shapes and dtypes, the precision, block reuse, the torch and Python versions and the
AUTOPAR_/TORCH_ environment. It is used only while the code that made it is unchanged: the
entry records every source file loaded when it was stored (outside the standard library and
site-packages: autopar itself, the user's model files) with its content hash, and the list of
installed distributions (name and version) of each site-packages folder; a lookup hashes those
files again and lists those folders again, and any difference is a miss. Anything the key
cannot describe for certain (an object without a plain state, a class without a source file, a
large tensor attribute off meta) makes the request uncacheable: it is captured as without a cache.

Folder: $AUTOPAR_CACHE_DIR/captures, else $XDG_CACHE_HOME/autopar/captures, else
~/.cache/autopar/captures. AUTOPAR_CAPTURE_CACHE=0 (or `--no-capture-cache`) turns it off.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import json
import site
import stat
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from autopar.capture import graph_codec
from autopar.graph import OpGraph

FORMAT_VERSION = 5
"""Bumped when the entry layout changes (old entries then miss); 5: JSON, no pickle."""
ENTRY_SUFFIX = ".json"
_LEGACY_SUFFIX = ".pkl"
"""Entries of format 4 and before (pickled): never read, removed by `clear` and eviction."""
MAX_ENTRIES = 64
"""Entries kept; the least recently used beyond this are removed when one is stored."""
MAX_HASHED_TENSOR_NUMEL = 1 << 20
"""A plain (unregistered) tensor attribute off meta is keyed by its values up to this size."""
MAX_DESCRIBED_OBJECTS = 200_000
"""A model whose state is larger than this many objects is not cached."""
SWITCH_ENV = "AUTOPAR_CAPTURE_CACHE"
DIR_ENV = "AUTOPAR_CACHE_DIR"
_OWN_ENV = (SWITCH_ENV, DIR_ENV, "AUTOPAR_JOBS")
"""Settings that do not change what is traced (AUTOPAR_JOBS: processes of the search)."""


class Uncacheable(Exception):
    """The request holds something the key cannot describe for certain."""


def enabled() -> bool:
    """Whether the cache is on (AUTOPAR_CAPTURE_CACHE unset, or anything but 0/off/false/no)."""
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """Where entries live (see the module docstring)."""
    root = os.environ.get(DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autopar")
    return Path(root) / "captures"


def clear() -> int:
    """Removes every entry; returns how many."""
    removed = 0
    for path in [*cache_dir().glob(f"*{ENTRY_SUFFIX}"), *cache_dir().glob(f"*{_LEGACY_SUFFIX}")]:
        with _ignoring_os_errors():
            path.unlink()
            removed += 1
    return removed


# --- keys ----------------------------------------------------------------------------------------

def spec_key(resolved, *, loss_fn, example_targets, precision: str, reuse_blocks: bool) -> Key | None:
    """Key of a built-in family's spec (`resolved`: a ResolvedSpec with a family): the model is
    autopar's own code (checked by the entry's source hashes) built from the canonical config."""
    return _key(("spec", resolved.name, repr(resolved.config)), loss_fn, (), {}, example_targets, precision,
                reuse_blocks)


def module_key(model: nn.Module, inputs: tuple, kwargs: dict, *, name: str, loss_fn, example_targets,
               precision: str, reuse_blocks: bool) -> Key | None:
    """Key of an nn.Module (`name`: the graph's model name) with its example inputs; None when
    it cannot be described for certain."""
    return _key(("module", name), loss_fn, inputs, kwargs, example_targets, precision, reuse_blocks, model=model)


def _key(head: tuple, loss_fn, inputs, kwargs, targets, precision, reuse_blocks, model=None) -> Key | None:
    if _has_global_hooks():
        return None
    describer, example = _Describer(), _Describer(tensor_values=False)
    try:
        parts = [repr(head), describer(model), describer(loss_fn), example(tuple(inputs)), example(dict(kwargs)),
                 example(targets)]
    except (Uncacheable, RecursionError):  # RecursionError: state nested too deep to describe
        return None
    environment = sorted((name, value) for name, value in os.environ.items()
                         if name.startswith(("AUTOPAR_", "TORCH_", "PYTORCH_")) and name not in _OWN_ENV)
    parts += [repr((FORMAT_VERSION, precision, reuse_blocks, torch.__version__, sys.version, sys.platform,
                    str(torch.get_default_dtype()), environment))]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return Key(digest=digest.hexdigest()[:32], uses_main="__main__" in describer.modules | example.modules)


@dataclass(frozen=True, kw_only=True)
class Key:
    """Where a request's entry lives."""

    digest: str
    """Hash of everything the request names (the entry's file name)."""
    uses_main: bool
    """Something described is defined in the running script, whose source then counts too."""


def _has_global_hooks() -> bool:
    from torch.nn.modules import module as module_file

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks", "_global_module_registration_hooks",
             "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
    return any(getattr(module_file, name, None) for name in names)


class _Describer:
    """Text that names a value's whole state (what tracing can read), or Uncacheable."""

    def __init__(self, *, tensor_values: bool = True) -> None:
        self.tensor_values = tensor_values
        """Whether plain tensors are keyed by their values (module attributes) or not (inputs,
        which capture replaces with meta tensors)."""
        self.memo: dict[int, str] = {}
        self.keep: list = []  # described objects stay alive, so that their ids are not reused
        self.count = 0
        self.modules: set[str] = set()
        """Python modules whose classes and functions were described."""

    def __call__(self, value) -> str:
        self.count += 1
        if self.count > MAX_DESCRIBED_OBJECTS:
            raise Uncacheable("too many objects")
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return repr(value)
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return f"{type(value).__name__}:{value}"
        if isinstance(value, enum.Enum):
            return f"{_class_name(type(value))}.{value.name}"
        return self._memoized(value, self._describe)

    def _memoized(self, value, describe) -> str:
        """An object seen before (a shared module, a tied parameter, a cycle) reads as its
        number; the first time as its number and its state."""
        if id(value) in self.memo:
            return self.memo[id(value)]
        reference = self.memo[id(value)] = f"#{len(self.memo)}"
        self.keep.append(value)
        return f"{reference}={describe(value)}"

    def _describe(self, value) -> str:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, values=self.tensor_values)
        if isinstance(value, (tuple, list, set, frozenset)):
            items = [self(item) for item in value]
            return f"{type(value).__name__}({', '.join(sorted(items) if isinstance(value, (set, frozenset)) else items)})"
        if isinstance(value, dict):
            return f"{_class_name(type(value))}{{{', '.join(f'{self(k)}: {self(v)}' for k, v in value.items())}}}"
        if isinstance(value, type):
            _check_source(value, self.modules)
            return f"class:{_class_name(value)}"
        if isinstance(value, types.FunctionType):
            return self._function(value)
        if isinstance(value, types.MethodType):
            return f"method:{self(value.__func__)} of {self(value.__self__)}"
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(value).__name__ in (
                "OpOverload", "OpOverloadPacket", "method_descriptor", "wrapper_descriptor"):
            owner = getattr(value, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType):
                return f"builtin:{getattr(value, '__qualname__', value)} of {self(owner)}"
            return f"builtin:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
        if isinstance(value, functools.partial):
            return f"partial({self(value.func)}, {self(value.args)}, {self(value.keywords)})"
        if isinstance(value, types.ModuleType):
            return f"module:{value.__name__}"
        state = getattr(value, "__dict__", None)
        if not isinstance(state, dict) or hasattr(type(value), "__slots__") and type(value).__slots__:
            raise Uncacheable(f"a {type(value).__name__} has no plain state")
        _check_source(type(value), self.modules)
        if isinstance(value, nn.Module):
            return f"{_class_name(type(value))}({self._module_state(state)})"
        return f"{_class_name(type(value))}({self(state)})"

    def _module_state(self, state: dict) -> str:
        parts = []
        for name, item in state.items():
            if name in ("_parameters", "_buffers"):
                parts.append(f"{name}: " + ", ".join(
                    f"{key}={self._memoized(tensor, functools.partial(self._tensor, values=False))}"
                    if tensor is not None else f"{key}=None" for key, tensor in item.items()))
            else:
                parts.append(f"{name}: {self(item)}")
        return "; ".join(parts)

    def _tensor(self, tensor: torch.Tensor, *, values: bool = True) -> str:
        """Shape, dtype, layout and device (capture replaces parameters and buffers with meta
        tensors, so their values never matter); a plain tensor attribute's values may (a size
        read with .item()), so they are hashed, or the request is not cached."""
        if type(tensor) not in _PLAIN_TENSOR_TYPES or tensor.is_sparse:
            raise Uncacheable(f"a tensor of type {type(tensor).__name__}")
        text = (f"tensor({tuple(tensor.shape)}, {tensor.dtype}, {tuple(tensor.stride())}, {tensor.device.type}, "
                f"grad={tensor.requires_grad}, param={isinstance(tensor, nn.Parameter)}")
        if values and tensor.device.type != "meta":
            if tensor.numel() > MAX_HASHED_TENSOR_NUMEL or tensor.device.type != "cpu":
                raise Uncacheable("a large tensor attribute")
            data = tensor.detach().contiguous()
            text += ", " + hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return text + ")"

    def _function(self, function: types.FunctionType) -> str:
        self.modules.add(function.__module__)
        module = sys.modules.get(function.__module__)
        if module is None or not _has_source_file(module):
            raise Uncacheable(f"{function.__qualname__} has no source file")
        code = function.__code__
        closure = tuple(cell.cell_contents for cell in function.__closure__ or ())
        return (f"function:{function.__module__}.{function.__qualname__}@{code.co_firstlineno}:"
                f"{hashlib.sha256(code.co_code).hexdigest()[:16]}:{self(function.__defaults__)}:"
                f"{self(function.__kwdefaults__)}:{self(closure)}")


_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter, getattr(nn.parameter, "Buffer", nn.Parameter))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_source(cls: type, modules: set[str]) -> None:
    """Every class in the MRO comes from a file the entry can hash (or a built-in module)."""
    for klass in cls.__mro__:
        modules.add(klass.__module__)
        module = sys.modules.get(klass.__module__)
        if module is None or not _has_source_file(module):
            raise Uncacheable(f"class {klass.__qualname__} has no source file")


@functools.lru_cache(maxsize=None)
def _builtin_module_names() -> frozenset[str]:
    return frozenset(sys.builtin_module_names)


def _has_source_file(module: types.ModuleType) -> bool:
    if module.__name__ in _builtin_module_names():
        return True
    path = getattr(module, "__file__", None)
    return bool(path) and os.path.isfile(path)


# --- dependencies --------------------------------------------------------------------------------

def _library_dirs() -> tuple[str, ...]:
    """site-packages folders: their code is keyed by the distributions installed there."""
    dirs = set(site.getsitepackages()) if hasattr(site, "getsitepackages") else set()
    with _ignoring_os_errors():
        dirs.add(site.getusersitepackages())
    paths = sysconfig.get_paths()
    dirs |= {paths["purelib"], paths["platlib"]}
    return tuple(sorted(os.path.realpath(path) for path in dirs if path))


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])}))


def _not_hashed_prefixes(folders: tuple[str, ...]) -> tuple[str, ...]:
    """The folders as given and as spelled through sys.prefix and sys.base_prefix (a module's
    __file__ is usually one of these): most modules are skipped without resolving links."""
    spelled = set(folders)
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        real = os.path.realpath(prefix)
        spelled |= {prefix + folder[len(real):] for folder in folders if folder.startswith(real + os.sep)}
    return tuple(sorted(folder + os.sep for folder in spelled))


def _distributions(library_dirs: tuple[str, ...]) -> tuple[str, ...]:
    """The installed distributions (their metadata folders name name and version) and .pth files."""
    found = []
    for folder in library_dirs:
        with _ignoring_os_errors():
            found += [f"{folder}/{name}" for name in os.listdir(folder)
                      if name.endswith((".dist-info", ".egg-info", ".egg-link", ".pth"))]
    return tuple(sorted(found))


def dependencies(*, with_main: bool = False) -> dict:
    """What the loaded code is: each loaded source file outside the standard library and
    site-packages with its content hash, and the installed distributions. The running script
    (`__main__`) counts only `with_main` (the key described something defined there): editing
    a driver script that only calls autopar keeps its captures."""
    library, stdlib = _library_dirs(), _stdlib_dirs()
    skipped = _not_hashed_prefixes(library + stdlib)
    files = {}
    for name, module in list(sys.modules.items()):
        if name == "__main__" and not with_main:
            continue
        try:
            path = getattr(module, "__file__", None)
        except Exception:  # noqa: BLE001 - a lazy module that cannot say: its package's files still count
            continue
        if not isinstance(path, str) or not path or path.startswith(skipped):
            continue
        path = os.path.realpath(path)
        if path in files or path.startswith(skipped):
            continue
        digest = _file_hash(path)
        if digest is not None:
            files[path] = digest
    return {"files": files, "distributions": _distributions(library)}


def _file_hash(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return None


def _current(recorded) -> bool:
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
        return False
    if recorded.get("distributions") != list(_distributions(_library_dirs())):
        return False
    return all(isinstance(path, str) and _file_hash(path) == digest for path, digest in recorded["files"].items())


# --- entries -------------------------------------------------------------------------------------
#
# An entry is two lines of JSON: a header (format, the code it was made with, the model's name)
# and the graph (graph_codec.py). Nothing read is unpickled, so an entry can hold no code. Entries
# are trusted no further than the folder: it is made owner-only (0700), and a folder or an entry
# that another user owns or may write is not read (nor written into), with one warning.

_warned: set[str] = set()


def entry_path(key: Key) -> Path:
    return cache_dir() / f"{key.digest}{ENTRY_SUFFIX}"


def lookup(key: Key) -> OpGraph | None:
    """The stored graph of `key` if its recorded code is unchanged, else None."""
    path = entry_path(key)
    try:
        if not _trusted(path.parent) or not _trusted(path):
            return None
        with open(path, "rb") as handle:
            header = json.loads(handle.readline())
            if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION or \
                    not _current(header.get("dependencies")):
                return None
            graph = graph_codec.decode(handle.read().decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):  # a damaged or foreign entry is a miss (and is replaced)
        return None
    with _ignoring_os_errors():
        os.utime(path)  # least recently used goes first
    return graph


def store(key: Key, graph: OpGraph) -> Path | None:
    """Saves `graph` under `key` with the code loaded now; returns the file (None if the folder
    cannot be written, or is not the user's own: the cache is then simply not used)."""
    path = entry_path(key)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        body = graph_codec.encode(graph)
        header = json.dumps({"format": FORMAT_VERSION, "dependencies": dependencies(with_main=key.uses_main),
                             "model": graph.model_name})
        _make_private(path.parent)
        if not _trusted(path.parent):
            return None
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(header + "\n" + body)
        os.replace(temporary, path)
    except (OSError, graph_codec.CodecError):
        with _ignoring_os_errors():
            temporary.unlink()
        return None
    _evict(path.parent)
    return path


def _make_private(folder: Path) -> None:
    """The folder, created owner-only; one of this user's own made before (0755) becomes 0700."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if hasattr(os, "getuid") and info.st_uid == os.getuid() and info.st_mode & 0o077:
        os.chmod(folder, 0o700)


def _trusted(path: Path) -> bool:
    """Whether `path` (the folder or an entry) is this user's own and nobody else may write it;
    else one warning on stderr says why it is not used and how to fix it."""
    info = path.stat()
    owner = os.getuid() if hasattr(os, "getuid") else info.st_uid
    if info.st_uid == owner and not info.st_mode & 0o022:
        return True
    reason = (f"it belongs to another user (uid {info.st_uid})" if info.st_uid != owner
              else f"others may write it (mode {stat.filemode(info.st_mode)})")
    fix = f"chmod go-w {path}" if info.st_uid == owner else f"remove it, or set {DIR_ENV} to a folder of your own"
    if str(path) not in _warned:
        _warned.add(str(path))
        print(f"autopar: the capture cache does not use {path}: {reason}, so anyone could plant a graph there; "
              f"{fix} (the cache stays off for it)", file=sys.stderr, flush=True)
    return False


def _evict(folder: Path) -> None:
    with _ignoring_os_errors():
        for path in folder.glob(f"*{_LEGACY_SUFFIX}"):
            path.unlink()
        entries = sorted(folder.glob(f"*{ENTRY_SUFFIX}"), key=lambda path: path.stat().st_mtime)
        for path in entries[:max(0, len(entries) - MAX_ENTRIES)]:
            path.unlink()


class _ignoring_os_errors:
    """`with _ignoring_os_errors():` a cache that cannot be read or written is not used."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        return kind is not None and issubclass(kind, OSError)
