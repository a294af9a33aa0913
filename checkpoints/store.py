"""Converted checkpoints: the folder every start after the first loads from.

A converted folder holds
    config.json     `ModelConfig.to_json()`
    params/         the params pytree, saved with orbax in the source's dtype (float32, or
                    float16 / bfloat16 where it stored those), but for the matrices packed/
                    holds; restored in the dtype asked for (default float32)
    packed/         where the source stored matrices block-quantized (GGUF Q8_0, Q4_0, Q4_1,
                    Q5_0, Q5_1, Q2_K to Q6_K, IQ4_NL, IQ4_XS),
                    those matrices as they are, in the CPU kernels' grouped layout (orbax,
                    uint8); the marker's "packed" names them, with their formats and shapes.
                    They are stored once: read as float32, each is dequantized from its blocks
                    (`block_layout.unpack_grouped`: GGUF's own values, bit for bit)
    <tokenizer>     tokenizer files, byte for byte as given (tokenizer.json, tokenizer.model, ...)
    cadence.json    the marker: format version, source, dtype, tokenizer file names
`save_converted` builds it in a sibling temporary folder, writes the marker last and renames
the folder into place, so a crash never leaves something `is_converted` accepts. Restores are
checked against `abstract_params(config)`: a tree with other names, shapes or dtypes is refused
with a `CheckpointError` before any data is read.

Non-goals: sharded saves (a converted checkpoint is written from one host), keeping several
versions.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.hf import FLOAT_DTYPES, Params
from cadence.model.config import ModelConfig
from cadence.model.block_layout import unpack_grouped
from cadence.model.params import abstract_params, nest

Shardings = Callable[[ModelConfig], Any]
# 2: packed/; 3: packed/ holds Q5_0 and the K-quants too; 4: not in params/; 5: params/ in the
# source's float dtypes; 6: packed/ holds IQ4_NL, IQ4_XS, Q5_1, Q3_K and Q2_K too; 7: the
# config's pooling and the tokenizer's add_eos_token (an embedding model's)
FORMAT_VERSION = 7
# `load_converted`'s dtype for every leaf as params/ stores it (a checkpoint's 16-bit floats
# stay 16-bit), rather than one dtype for all.
AS_STORED = "stored"
MARKER = "cadence.json"
_RESERVED = {MARKER, "config.json", "params", "packed"}
Packed = dict[tuple[str, ...], tuple[np.ndarray, str]]  # path -> (grouped array, GGUF type)


def save_converted(folder: str | Path, config: ModelConfig, params: Params,
                   tokenizer_files: dict[str, bytes] | None = None, *, source: str = "",
                   packed: Packed | None = None) -> None:
    """Writes a complete converted checkpoint at `folder`, replacing any folder already there;
    `packed`: the source's block-quantized matrices (`checkpoints.gguf.load_packed`), which
    stand for their params leaves exactly: those leaves are not saved (`params` may hold them,
    or their `jax.ShapeDtypeStruct`s, or lack them)."""
    folder = Path(folder).absolute()
    tokenizer_files = tokenizer_files or {}
    packed = packed or {}
    for name in tokenizer_files:
        if Path(name).name != name or name in _RESERVED or name.startswith("."):
            raise CheckpointError(f"tokenizer file name {name!r} is not allowed; pass plain "
                                  f"file names other than {', '.join(sorted(_RESERVED))}")
    params = nest((path, leaf) for path, leaf in _flatten(params).items() if path not in packed)
    _check_tree(_shapes(params), packed, config, f"params for {config.name}",
                "build the params from this config")

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(config.to_json())
        with _quiet(), _host_checkpointer() as checkpointer:
            checkpointer.save(tmp / "params", args=ocp.args.PyTreeSave(params))
            if packed:
                checkpointer.save(tmp / "packed", args=ocp.args.PyTreeSave(
                    nest((p, a) for p, (a, _) in packed.items())))
        for name, data in tokenizer_files.items():
            (tmp / name).write_bytes(data)
        marker = {"format_version": FORMAT_VERSION, "source": source, "dtype": "source",
                  "tokenizer_files": sorted(tokenizer_files),
                  "packed": {"/".join(p): {"type": kind, "shape": list(a.shape)}
                             for p, (a, kind) in packed.items()}}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        _replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _host_checkpointer() -> ocp.Checkpointer:
    """orbax's checkpointer for a tree of NumPy arrays, writing them as they are. Its default
    handler deep-copies every host array first, to guard a save that runs in the background
    while the caller changes them: this save is synchronous and nothing changes the arrays,
    and the copy was a second full-size tree at the conversion's peak (3.2 GiB of a 1.7B bf16
    checkpoint's 8.8 GB). The format on disk is the same."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))  # (orbax warns of a registry without it)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


def load_converted(folder: str | Path, shardings: Shardings | None = None,
                   dtype: str | None = None, skip: Collection[tuple[str, ...]] = (),
                   packed: Packed | None = None) -> tuple[ModelConfig, Params]:
    """Restores (config, params) from a folder `save_converted` wrote. Leaves come back as the
    kind that was saved: numpy arrays, or jax arrays on the default device. With `shardings`
    (config -> a tree of shardings, e.g. `TensorParallel.storage_shardings`), each leaf is
    restored straight into its shards: every device reads only its part, and no host holds a
    whole copy. `dtype`: cast to it as restored (default: float32; `AS_STORED`: each leaf as
    params/ holds it). The matrices packed/ holds are dequantized from their blocks, one at a
    time. `skip`: paths whose values are not read, left as `jax.ShapeDtypeStruct`s (the
    matrices an engine reads from the packed blocks instead: `load_packed`). `packed`: the
    folder's blocks, where already read (`load_packed`), so that they are not read again."""
    folder = Path(folder).absolute()
    marker = read_marker(folder)
    if marker["dtype"] != "source":
        raise CheckpointError(f"{folder / MARKER}: dtype {marker['dtype']!r} is not supported; "
                              "convert the checkpoint again")
    try:
        config = ModelConfig.from_json((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{folder / 'config.json'} is unreadable ({e}); delete {folder} "
                              "and convert again") from e
    as_stored = dtype == AS_STORED
    target = _flatten(abstract_params(config, "float32" if as_stored else dtype or "float32",
                                      shardings=shardings(config) if shardings else None))
    packed_paths = {tuple(key.split("/")) for key in marker.get("packed") or {}}
    unknown = set(skip) - set(target)
    if unknown:
        raise ValueError(f"skip names paths {sorted(unknown)} that {config.name}'s params lack")
    with _quiet(), ocp.StandardCheckpointer() as checkpointer:
        try:
            stored = checkpointer.metadata(folder / "params").item_metadata.tree
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{folder / 'params'} is unreadable ({_reason(e)}); delete {folder} "
                                  "and convert again") from e
    _check_tree(_shapes(stored), packed_paths, config, f"{folder / 'params'}",
                f"delete {folder} and convert again")
    if as_stored:  # each leaf in the dtype params/ holds it in
        target |= {path: jax.ShapeDtypeStruct(shape, dtype,
                                              sharding=getattr(target[path], "sharding", None))
                   for path, (shape, dtype) in _shapes(stored).items()}
    wanted = nest((path, leaf) for path, leaf in target.items()
                  if path not in skip and path not in packed_paths)
    with _quiet(), ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        restored = _flatten(checkpointer.restore(folder / "params", args=ocp.args.PyTreeRestore(
            item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
            partial_restore=True)))
    derive = packed_paths - set(skip)
    if derive:
        blocks = packed if packed is not None else load_packed(folder, derive)
        for path in derive:
            restored[path] = _from_blocks(path, blocks[path][0], target[path])
    return config, nest((path, restored.get(path, leaf)) for path, leaf in target.items())


def _from_blocks(path: tuple[str, ...], blocks: np.ndarray, like: jax.ShapeDtypeStruct):
    """A params leaf from its packed blocks: GGUF's own values, in `like`'s shape, dtype and
    place. The blocks hold a kernel as [in, out], and the embedding transposed."""
    embedding = path[-1] == "embedding"
    w = unpack_grouped(blocks, like.shape[0] if embedding else like.shape[1])
    w = (np.ascontiguousarray(w.T) if embedding else w).astype(like.dtype, copy=False)
    sharding = getattr(like, "sharding", None)
    return w if sharding is None else jax.device_put(w, sharding)


def load_packed(folder: str | Path, paths: Collection[tuple[str, ...]] | None = None) -> Packed:
    """The block-quantized matrices `save_converted` stored with the checkpoint (read-only
    NumPy views of CPU device buffers), by path (`paths` alone, where given); empty where the
    source had none."""
    folder = Path(folder).absolute()
    entries = read_marker(folder).get("packed") or {}
    if paths is not None:
        entries = {key: entries[key] for key in ("/".join(path) for path in paths) if key in entries}
    if not entries:
        return {}
    # Restored into the CPU's own buffers (aligned as XLA aligns them), which an engine's
    # device_put then takes as they are: the file's blocks are in memory once, not read into
    # NumPy's buffers and copied again.
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = nest((tuple(key.split("/")),
                   jax.ShapeDtypeStruct(tuple(e["shape"]), np.uint8, sharding=host))
                  for key, e in entries.items())
    with _quiet(), ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        try:
            arrays = checkpointer.restore(folder / "packed", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{folder / 'packed'} is unreadable ({_reason(e)}); delete {folder} "
                                  "and convert again") from e
    return {path: (np.asarray(leaf), entries["/".join(path)]["type"])
            for path, leaf in _flatten(arrays).items()}


def _reason(error: Exception) -> str:
    """A checkpoint reader's error, without the kilobytes of store specification tensorstore
    appends to it."""
    return str(error).split(" [tensorstore_spec", 1)[0]


def is_converted(folder: str | Path) -> bool:
    """True when `folder` is a complete converted checkpoint of this format version."""
    try:
        read_marker(Path(folder))
    except CheckpointError:
        return False
    return True


def read_marker(folder: str | Path) -> dict[str, Any]:
    """The `cadence.json` of a complete converted folder; `CheckpointError` for anything else."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder} is not a complete converted checkpoint (no {MARKER}); "
                              "delete it and convert again") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / MARKER} is unreadable ({e}); delete {folder} and "
                              "convert again") from e
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION:
        version = marker.get("format_version") if isinstance(marker, dict) else None
        raise CheckpointError(f"{folder} has converted-checkpoint format {version!r}, this "
                              f"cadence reads {FORMAT_VERSION}; delete it and convert again")
    for name in ("config.json", "params", *(["packed"] if marker.get("packed") else []),
                 *marker.get("tokenizer_files", [])):
        if not (folder / name).exists():
            raise CheckpointError(f"{folder} lacks {name}; delete it and convert again")
    return marker


def load_tokenizer_files(folder: str | Path) -> dict[str, bytes]:
    """The tokenizer files stored with a converted checkpoint, by name."""
    folder = Path(folder)
    return {name: (folder / name).read_bytes() for name in read_marker(folder)["tokenizer_files"]}


def _flatten(tree: Any) -> dict[tuple[str, ...], Any]:
    """A pytree's leaves by their paths of keys."""
    return {tuple(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shape(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """An array's (or array metadata's) (shape, dtype)."""
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    """Flattens a pytree of arrays (or array metadata) to path → (shape, dtype)."""
    return {path: _shape(leaf) for path, leaf in _flatten(tree).items()}


def _check_tree(found: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]],
                packed_paths: Collection[tuple[str, ...]], config: ModelConfig, what: str,
                fix: str) -> None:
    """params/ as saved (`found`: path -> (shape, dtype)) against `config`'s tree, the matrices
    packed/ holds instead of it counted as the float32 leaves they stand for, and float16 or
    bfloat16 leaves as float32 ones."""
    want = _shapes(abstract_params(config))
    unknown = set(packed_paths) - set(want)
    if unknown:
        raise CheckpointError(f"packed names {sorted(unknown)}, which {config.name}'s params lack; {fix}")
    found = found | {path: want[path] for path in packed_paths}
    # A leaf stored in 16 bits stands for the float32 leaf it widens to.
    found = {path: (shape, np.dtype(np.float32) if np.dtype(dtype) in FLOAT_DTYPES.values()
                    else dtype) for path, (shape, dtype) in found.items()}
    missing = ["/".join(p) for p in want if p not in found]
    unexpected = ["/".join(p) for p in found if p not in want]
    wrong = [f"{'/'.join(p)} {found[p][1]}{list(found[p][0])} (want {want[p][1]}"
             f"{list(want[p][0])})" for p in want if p in found and found[p] != want[p]]
    if missing or unexpected or wrong:
        problems = [f"{label} [{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}]"
                    for label, names in (("missing", missing), ("unexpected", unexpected),
                                         ("wrong shape/dtype", wrong)) if names]
        raise CheckpointError(f"{what} do not match {config.name}'s config: "
                              f"{'; '.join(problems)}; {fix}")


def _replace(tmp: Path, folder: Path) -> None:
    """Renames `tmp` to `folder`; an old `folder` is moved aside first and deleted after."""
    old = None
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        folder.rename(old)
    tmp.rename(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet():
    """orbax logs every step of a save or restore at INFO through absl; keep only warnings."""
    level = logging.get_verbosity()
    logging.set_verbosity(min(level, logging.WARNING))  # absl: lower is quieter
    try:
        yield
    finally:
        logging.set_verbosity(level)
