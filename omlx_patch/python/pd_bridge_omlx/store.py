"""oMLX's block store: putting block files into oMLX's SSD prefix-cache index.

The bottom of the decode side (``hooks`` → ``bridge`` → ``store``): it knows oMLX's cache
manager and the core's validator, and imports neither the hooks nor the bridge.

Two ways a block reaches the index, each validated exactly once by the Rust core first:

- a block the bridge's writer just wrote: ``ingest`` hands over its ``LandedBlock`` (path, hash,
  and the verdict of the validator the writer ran on the file under its final name), and
  ``register_landed`` uses that verdict; nothing is recomputed or read again here;
- a file found on disk (``rescan``, and oMLX's own reads through the hooks' guard):
  ``register_file`` / ``check_before_read`` validate it with ``inspect_block``.

Either way, where this oMLX has one, oMLX's own compatibility check (upstream's cache
signature) runs last; a block it refuses is never indexed.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from . import versions
from ._native import BlockRejected, ConfigError, LandedBlock, clean_stale_temps, inspect_block

logger = logging.getLogger("pd_bridge_omlx")

# Serialises our additions to oMLX's SSD index (rescan, the bridge's ingest threads).
index_lock = threading.Lock()


def block_path(cache_dir: str | Path, hash_hex: str) -> Path:
    """Where oMLX keeps block ``hash_hex``: ``<cache>/<hash[0]>/<hash>.safetensors``."""
    return Path(cache_dir) / hash_hex[0] / f"{hash_hex}.safetensors"


_model_dirs: dict[str, str | None] = {}


def model_dir_for(model_name: str) -> str | None:
    """The directory of the model a block names, whose config.json gives the plan its tensors
    are checked against: the name itself where oMLX keys blocks by the model's path (the fork),
    else ``<--model-dir>/<id>`` of this ``omlx serve`` (upstream keys blocks by the model id).
    None when neither holds a config.json (then names and framing only)."""
    if model_name in _model_dirs:
        return _model_dirs[model_name]
    candidates = [Path(model_name)]
    argv = sys.argv
    for i, a in enumerate(argv):
        root = argv[i + 1] if a == "--model-dir" and i + 1 < len(argv) else (a.split("=", 1)[1] if a.startswith("--model-dir=") else None)
        if root:
            candidates.append(Path(root).expanduser().resolve() / model_name)
    found = None
    for c in candidates:
        try:
            if c.is_absolute() and (c / "config.json").is_file():
                found = str(c)
                break
        except (OSError, ValueError):
            continue
    _model_dirs[model_name] = found
    return found


def check_before_read(file_path, fmt: str) -> None:
    """Validate a block file oMLX is about to read into its index (its start-up scan): names
    and framing, then every tensor's dtype and shape against the plan of the model the block
    names (oMLX's own check then keeps out a block of a model it did not load). Raises
    ``BlockRejected``."""
    _, _, _, model_name, _ = inspect_block(str(file_path), omlx_format=fmt)
    model_dir = model_dir_for(model_name)
    if model_dir is not None:
        try:
            inspect_block(str(file_path), omlx_format=fmt, model_dir=model_dir)
        except (ConfigError, OSError) as e:  # a model the core has no plan for
            logger.info("pd-bridge: blocks of %s are checked without tensor shapes: %s", model_name, e)
            _model_dirs[model_name] = None


def sweep_temps(cache_dir) -> None:
    """Remove the temp files a crashed block writer left in ``cache_dir`` (never fails)."""
    try:
        removed = clean_stale_temps(str(cache_dir))
    except Exception:  # never fail oMLX's cache start-up
        logger.exception("pd-bridge: sweeping stale temp files in %s failed", cache_dir)
        return
    for path in removed:
        logger.info("pd-bridge: removed stale block temp file %s", path)


def _digest(path: Path) -> bytes | None:
    try:
        return bytes.fromhex(path.stem)
    except ValueError:
        return None


def _add(manager, path: Path, digest: bytes | None) -> int:
    """Index a block the core has validated: oMLX reads its metadata and, where this oMLX has
    one, runs its own compatibility check. Returns its size; raises ``BlockRejected``."""
    # Validated by the core already: read the metadata with oMLX's own reader, not through the
    # hooks' guard that would validate the file a second time.
    read = type(manager)._read_file_metadata
    meta = getattr(read, "__wrapped__", read)(manager, path)
    if meta is None:
        raise BlockRejected(f"{path}: oMLX could not read its metadata")
    compatible = getattr(manager, "_is_compatible_block", None)
    if compatible is not None and not compatible(meta):
        why = None
        reason = getattr(manager, "signature_mismatch_reason", None)
        if reason is not None:
            why = reason(getattr(meta, "cache_signature", ""))
        raise BlockRejected(f"{path}: oMLX's compatibility check refuses it ({why or 'model, layer count, block size or layer types differ from the loaded model'})")
    manager._enforce_size_limit_for_new_block()
    incompatible = getattr(manager, "_incompatible_index", None)
    if incompatible is not None and digest is not None:
        incompatible.remove(digest)
    manager._index.add(meta)
    return meta.file_size


def register_landed(manager, block: LandedBlock) -> int | None:
    """Put a block the bridge's writer just wrote into oMLX's index, from what the writer handed
    over: its path and the verdict of the one validation the core ran on it (against the
    format, model, block size, cache directory and the decoder's plan). Returns its size, or
    None when oMLX already knew it. Raises ``BlockRejected`` when it must not be served."""
    path, digest = Path(block.path), bytes.fromhex(block.hash_hex)
    with index_lock:
        if manager._index.contains(digest):
            return None
        if block.rejected is not None:
            raise BlockRejected(block.rejected)
        return _add(manager, path, digest)


def drop_unindexed(manager, block: LandedBlock) -> None:
    """Take a refused block's file off the disk unless oMLX indexed it meanwhile: outside the
    index, oMLX's size limit would never count or evict it."""
    with index_lock:
        if not manager._index.contains(bytes.fromhex(block.hash_hex)):
            Path(block.path).unlink(missing_ok=True)


def register_file(manager, path: Path, model_name: str | None, block_size: int | None, model_dir: str | None = None, move_bad: bool = False) -> int | None:
    """Put one block file found on disk into oMLX's SSD index, validated first (against the
    installed oMLX's block format, the model and block size when given, and with ``model_dir``
    every tensor's dtype and shape against the decoder's plan) and, where this oMLX has one,
    passed through its own compatibility check (upstream's cache signature). Returns its size,
    or None when oMLX already knew it. Raises ``BlockRejected`` when it must not be served;
    ``move_bad``: a link, FIFO, directory or corrupt file on the name is moved into the
    quarantine first. The caller holds ``index_lock``."""
    digest = _digest(path)
    if digest is not None and manager._index.contains(digest):
        return None
    inspect_block(str(path), model_name=model_name, block_size=block_size, omlx_format=versions.detect().omlx_format, model_dir=model_dir,
                  cache_dir=str(manager._cache_dir), move_bad=move_bad)  # fmt: skip
    return _add(manager, path, digest)


def rescan(manager, model_name: str | None = None, block_size: int | None = None, model_dir: str | None = None) -> dict:
    """Index block files in ``manager``'s cache directory that it does not know yet.

    Each is validated (and, when given, checked against the model, block size and the plan of
    the decoder in ``model_dir``) first, without following links or opening FIFOs. A file that
    can never be a block (a link, FIFO, directory, corrupt or misshapen file) is moved into the
    cache's quarantine directory, so the bridge can write the real block on its name; a sound
    block of another model is left alone. Stale writer temp files are swept first.
    Returns ``{"registered": [...], "rejected": [[path, reason], ...], "known": n}``.
    """
    registered, rejected, known = [], [], 0
    root = Path(manager._cache_dir)
    sweep_temps(root)
    for sub in manager.SUBDIR_CHARS:
        for path in sorted((root / sub).glob("*.safetensors")):
            try:
                with index_lock:
                    try:
                        size = register_file(manager, path, model_name, block_size, model_dir=model_dir, move_bad=True)
                    except ConfigError as e:  # a model the core has no plan for: names and framing only
                        logger.warning("pd-bridge: rescan checks no tensor shapes: %s", e)
                        model_dir = None
                        size = register_file(manager, path, model_name, block_size, move_bad=True)
            except BlockRejected as e:
                logger.warning("pd-bridge: not serving block %s", e)
                rejected.append([str(path), str(e)])
                continue
            if size is None:
                known += 1
            else:
                registered.append(path.stem)
    logger.info("pd-bridge: rescan registered %d blocks, rejected %d, %d already known", len(registered), len(rejected), known)
    return {"registered": registered, "rejected": rejected, "known": known}
