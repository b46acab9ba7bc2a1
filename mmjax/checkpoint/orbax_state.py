"""Checkpoints of a whole run with Orbax: train state, data-iterator position and run metadata.

Layout: `<checkpoint.dir>/<step>/{state,data,meta}`. A step folder appears only once every item is
written (Orbax writes into a temporary folder and renames it), so a run killed mid-save leaves at most
a temporary folder that the next run ignores and removes; the checkpoints before it stay valid.

- `state`: the `TrainState` pytree (params, optimizer state, step, loss scale), sharded arrays.
  Restore goes through abstract targets (`jax.ShapeDtypeStruct` carrying this run's `NamedSharding`s),
  so a checkpoint written on one mesh loads onto another (resharding happens in the read).
- `data`: the loader state after the last consumed batch (`PackingIterator.get_state()`: a stream
  position, not grain's per-worker state), one JSON file per process; the only place it is saved. It
  is valid for the same process count and global batch size, which `meta` records and resume checks;
  any `data.num_workers` resumes from it exactly (the batches do not depend on the worker count).
- `meta`: JSON with the resolved config, mesh, process count, loader workers and package versions.

Saves are asynchronous by default. Orbax's own async save returns only after the device-to-host copy
(seconds for a billion-parameter state: the loop stalls for it), so with `checkpoint.device_snapshot`
(default) `save` first copies the state into fresh device buffers (milliseconds: device memory
bandwidth), hands that snapshot to Orbax from a background thread and returns. The train step may then
donate the original buffers; the copy off the devices and the file writes overlap training. The
snapshot needs as much free device memory as the train state; if the copy does not fit, the save falls
back to Orbax's blocking copy with a warning. One save is in flight at a time: the next `save` (and
every read of the folder) first waits for it. Single-process runs only: with several processes, Orbax's
save barriers are device collectives, which must not be issued from a thread beside the train step's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import platform
import re
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mmjax.config import Config, to_dict
from mmjax.errors import CheckpointError
from mmjax.observe.console import demote_orbax_notices
from mmjax.observe.memory import is_device_oom

log = logging.getLogger(__name__)

STATE, DATA, META, PARAMS = "state", "data", "meta", "params"
ITEMS = (STATE, DATA, META, PARAMS)  # a training checkpoint has state/data/meta, a params-only one params/meta
FORMAT_VERSION = 1
# Top-level TrainState fields that earlier versions saved and this one no longer has: read and dropped on
# restore, so those checkpoints still resume. `rng`: a PRNG key split every step but read by no layer.
DROPPED_STATE_FIELDS = ("rng",)
_PACKAGES = ("mmjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


# ------------------------------------------------------------------------------------------------
# The `data` item: one JSON file per process with that process's iterator state.


class DataStateHandler(ocp.CheckpointHandler):
    """Saves a *snapshot* of the loader state (the one after the last batch the loop consumed).

    `grain.checkpoint.CheckpointHandler` calls `iterator.get_state()` at save time, which with a
    prefetching feed is ahead of the train loop; this handler writes the snapshot it is given (the
    JSON-able dict of `mmjax.data.loader.PackingIterator.get_state`) and returns it on restore instead
    of mutating an iterator.
    """

    @staticmethod
    def _file(directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory: epath.Path, args: DataStateSave) -> None:
        self._file(directory).write_text(json.dumps({"kind": "json", "value": args.state}))

    def restore(self, directory: epath.Path, args: DataStateRestore | None = None) -> Any:
        path = self._file(directory)
        if not path.exists():
            found = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
            raise CheckpointError(
                f"{path} does not exist (found {found}): the data state was written by a different "
                f"process count than this run's {jax.process_count()}")
        return json.loads(path.read_text())["value"]  # a bad file: `Checkpointer.restore` says corrupt

    def metadata(self, directory: epath.Path) -> None:
        return None

    def structure(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any  # the loader's JSON-able state dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


# ------------------------------------------------------------------------------------------------
# Metadata


def package_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed versions of the packages a result depends on (`extra`: more, e.g. a benchmark's peers)."""
    out = {"python": platform.python_version()}
    for name in (*_PACKAGES, *extra):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def run_meta(cfg: Config, mesh_sizes: dict[str, int], axis_names: tuple[str, ...], step: int) -> dict[str, Any]:
    """What a later run needs to judge whether (and how) it can continue from this checkpoint."""
    return {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": to_dict(cfg),
        "mesh": {"shape": dict(mesh_sizes), "axis_names": list(axis_names)},
        "process_count": jax.process_count(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "data": {"num_workers": cfg.data.num_workers, "global_batch_size": cfg.train.global_batch_size,
                 "seed": cfg.train.seed, "dataset": cfg.data.dataset},
        "versions": package_versions(),
    }


@jax.jit
def _copy_arrays(arrays: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(a) for a in arrays]  # not donated: XLA writes fresh buffers with the same shardings


def _device_copy(state: Any) -> Any | None:
    """A copy of `state`'s arrays in new device buffers (a snapshot the train step cannot donate away);
    None, with a warning, if device memory cannot hold it."""
    leaves, treedef = jax.tree.flatten(state)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    try:
        copies = _copy_arrays([leaves[i] for i in where])
    except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED: the snapshot does not fit next to the state
        if not is_device_oom(e):
            raise
        log.warning("checkpoint: no device memory for a snapshot of the train state (%s); this save blocks for "
                    "the device-to-host copy (set checkpoint.device_snapshot=false to skip the attempt)", one_line(e))
        return None
    for i, copy in zip(where, copies):
        leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# Abstract targets and shape checks


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with each array's sharding: the restore target for a state shaped like `tree`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def flat_leaves(tree: Any) -> dict[str, Any]:
    """{"params/decoder/embedding": leaf, ...}: the same keys for a TrainState, its saved dict and metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path): leaf
            for path, leaf in leaves if hasattr(leaf, "shape")}


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(s) for s in v.shape) for k, v in flat_leaves(tree).items()}


def check_shapes(saved: Any, target: Any, where: str, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose arrays differ in name or shape from this run's state (a different model);
    saved arrays named in `ignore` are not compared."""
    have, want = _flat_shapes(getattr(saved, "tree", saved)), _flat_shapes(target)
    have = {k: v for k, v in have.items() if k not in ignore}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        raise CheckpointError(
            f"{where} holds a different state tree: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}; it was written for another model config "
            f"(compare its meta config with this run's){_layer_layout_hint(missing, extra)}")
    for key in sorted(want, key=lambda k: (not k.startswith("params/"), k)):  # name a parameter first
        if have[key] != want[key]:
            raise CheckpointError(
                f"{where}: {key} has shape {have[key]} in the checkpoint but {want[key]} in this run; the "
                "model config differs (compare the checkpoint's meta config with this run's)")


_UNROLLED_LAYER = re.compile(r"/layers/\d+/")


def _layer_layout_hint(missing: list[str], extra: list[str]) -> str:
    """Where the trees differ only in how the layers are kept, the setting that reads the checkpoint."""
    def unrolled(keys: list[str]) -> bool | None:
        layer_keys = [k for k in keys if "/layers/" in k]
        return None if not layer_keys else all(_UNROLLED_LAYER.search(k) for k in layer_keys)

    saved, wanted = unrolled(extra), unrolled(missing)
    if saved is None or wanted is None or saved == wanted:
        return ""
    vision_only = all("/vision/" in k for k in missing + extra if "/layers/" in k)
    key = "model.vision.scan_layers" if vision_only else "model.scan_layers"
    return (f": its {'vision tower' if vision_only else ''}{' ' if vision_only else ''}layers are "
            f"{'unrolled' if saved else 'stacked'} and this run's are {'unrolled' if wanted else 'stacked'}; "
            f"resume it with {key}={str(not saved).lower()}")


def _dropped_fields(saved: Any, target: Any) -> dict[str, Any]:
    """{name: metadata} of the DROPPED_STATE_FIELDS a checkpoint holds and the target state lacks."""
    tree = getattr(saved, "tree", saved)
    if not dataclasses.is_dataclass(target) or not isinstance(tree, dict):
        return {}
    names = {f.name for f in dataclasses.fields(target)}
    return {k: tree[k] for k in DROPPED_STATE_FIELDS if k in tree and k not in names}


# ------------------------------------------------------------------------------------------------
# The manager


@dataclasses.dataclass
class Restored:
    state: Any
    data: Any  # this process's iterator state, or None if the checkpoint has none
    meta: dict[str, Any]
    step: int
    path: Path


def is_step_dir(path: Path) -> bool:
    return path.is_dir() and path.name.isdigit() and (path / META).is_dir()


class Checkpointer:
    """A thin policy layer over `ocp.CheckpointManager`: when to save, retention, checked restore."""

    def __init__(self, directory: str | Path, *, every_steps: int = 0, keep: int = 3, keep_every: int = 0,
                 async_save: bool = True, device_snapshot: bool = True, read_only: bool = False):
        self.directory = Path(directory).expanduser().absolute()
        self.every_steps = every_steps
        self.read_only = read_only
        # Multi-process: Orbax's save barriers are device collectives (sync_global_devices) that must not
        # interleave with the train step's collectives from another thread, so the hand-off stays in the loop.
        self.device_snapshot = async_save and device_snapshot and jax.process_count() == 1
        if async_save and device_snapshot and not self.device_snapshot and not read_only:
            log.info("checkpoint: %d processes, so saves use Orbax's blocking device-to-host copy (the device "
                     "snapshot hand-off runs Orbax's collective barriers off the train loop's thread)",
                     jax.process_count())
        self._saver: threading.Thread | None = None  # the background save of a device snapshot
        self._saver_error: BaseException | None = None
        if read_only:
            demote_orbax_notices()  # reading with read_only=True is the intent, not something to warn about
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint folder {self.directory} does not exist; pass an existing "
                                  "checkpoint folder (or step folder inside it) to train.resume")
        if not read_only and self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint.dir {self.directory} exists and is not a folder; pick another path")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            # Only temporary folders of interrupted saves are removed; finished steps never are.
            cleanup_tmp_directories=not read_only,
        )
        handlers = {STATE: ocp.StandardCheckpointHandler(), DATA: DataStateHandler(),
                    META: ocp.JsonCheckpointHandler(), PARAMS: ocp.StandardCheckpointHandler()}
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS,
                                                 item_handlers=handlers)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open checkpoint folder {self.directory}: {one_line(e)}") from e

    @classmethod
    def from_config(cls, cfg: Config) -> Checkpointer:
        c = cfg.checkpoint
        return cls(checkpoint_dir(cfg), every_steps=c.every_steps, keep=c.keep, keep_every=c.keep_every,
                   async_save=c.async_save, device_snapshot=c.device_snapshot)

    # -- saving ----------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        self._join_saver()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        self._join_saver()
        return self.manager.latest_step()

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int, state: Any, data_state: Any, meta: dict[str, Any], *, owned: bool = False) -> float:
        """Start saving `step` (async unless checkpoint.async=false); returns the seconds it blocked.

        `state` may be donated to the next train step as soon as this returns. `owned`: `state` is already a
        fresh copy nothing else holds (e.g. converted to canonical layer order), so it is its own snapshot.
        """
        start = time.perf_counter()
        self._join_saver()
        snapshot = (state if owned else _device_copy(state)) if self.device_snapshot else None
        if snapshot is not None:
            self._saver = threading.Thread(target=self._save_in_background, args=(step, snapshot, data_state, meta),
                                           name=f"mmjax-checkpoint-{step}")
            self._saver.start()
        else:
            self._save_items(step, state, data_state, meta)
        blocked = time.perf_counter() - start
        log.info("checkpoint: step %d saving to %s (blocked %.3fs%s)", step, self.directory, blocked,
                 ", device snapshot" if snapshot is not None else "")
        return blocked

    def is_saving(self) -> bool:
        """A save is still being handed over or written."""
        return (self._saver is not None and self._saver.is_alive()) or self.manager.is_saving_in_progress()

    def _save_items(self, step: int, state: Any, data_state: Any, meta: dict[str, Any]) -> None:
        items = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        if data_state is not None:
            items[DATA] = DataStateSave(data_state)
        if not self.manager.save(step, args=ocp.args.Composite(**items), force=True):
            raise CheckpointError(f"Orbax declined to save step {step} in {self.directory}")

    def _save_in_background(self, step: int, snapshot: Any, data_state: Any, meta: dict[str, Any]) -> None:
        try:
            self._save_items(step, snapshot, data_state, meta)
        except BaseException as e:  # re-raised in the train loop by the next save/wait
            self._saver_error = e

    def _join_saver(self) -> None:
        """Wait for the background hand-off of a device snapshot; re-raise its error in this thread."""
        if self._saver is not None:
            self._saver.join()
            self._saver = None
        if self._saver_error is not None:
            error, self._saver_error = self._saver_error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"saving a checkpoint in {self.directory} failed "
                                  f"({type(error).__name__}: {one_line(error)})") from error

    def save_params(self, step: int, params: Any, meta: dict[str, Any]) -> None:
        """A params-only checkpoint (conversion, serving exports): items params + meta, written synchronously."""
        self.manager.save(step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardSave(params),
                                                           META: ocp.args.JsonSave(meta)}), force=True)
        self.manager.wait_until_finished()

    def wait(self) -> None:
        self._join_saver()
        self.manager.wait_until_finished()

    def close(self) -> None:
        self._join_saver()
        self.manager.close()

    # -- restoring -------------------------------------------------------------------------------

    def read_meta(self, step: int) -> dict[str, Any]:
        self._join_saver()
        path = self.directory / str(step)
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as e:  # re-raised with the path: the folder is truncated or corrupt
            raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {one_line(e)}); it is "
                                  "truncated or corrupt: resume from another step (train.resume=<step>)") from e
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {path}: meta is not an mmjax checkpoint meta of format {FORMAT_VERSION}")
        return meta

    def is_params_only(self, step: int) -> bool:
        path = self.directory / str(step)
        return (path / PARAMS).is_dir() and not (path / STATE).is_dir()

    def param_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{"decoder/embedding": (shape, dtype)} from metadata only."""
        tree = _params_metadata(self.directory / str(step))
        return {k: (tuple(int(s) for s in v.shape), str(np.dtype(v.dtype))) for k, v in flat_leaves(tree).items()}

    def restore_params(self, step: int, target_params: Any) -> Any:
        """Params of a params-only checkpoint into this run's shapes/shardings; towers it lacks are skipped
        (e.g. a converted Llama gives only "decoder"), so the returned tree may be a subset."""
        path = self.directory / str(step)
        where = f"checkpoint {path}"
        try:
            saved = _params_metadata(path)
        except Exception as e:
            raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {one_line(e)}); it is truncated "
                                  "or corrupt") from e
        unknown = sorted(set(saved) - set(target_params))
        if unknown:
            raise CheckpointError(f"{where} holds towers {unknown} that this model does not have")
        target = {k: target_params[k] for k in saved}
        check_shapes(saved, target, where)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                **{PARAMS: ocp.args.StandardRestore(abstract_like(target))}))
        except Exception as e:
            raise CheckpointError(f"{where} cannot be restored ({type(e).__name__}: {one_line(e)}); it is "
                                  "truncated or corrupt") from e
        return out[PARAMS]

    def restore(self, step: int, target_state: Any) -> Restored:
        """Read `step` into the shapes and shardings of `target_state` (arrays or ShapeDtypeStructs)."""
        path = self.directory / str(step)
        if step not in self.manager.all_steps():
            raise CheckpointError(f"{self.directory} has no complete checkpoint for step {step}; "
                                  f"available steps: {self.all_steps() or 'none'}")
        where = f"checkpoint {path}"
        meta = self.read_meta(step)
        try:
            saved_tree = self.manager.item_metadata(step)[STATE]
        except Exception as e:  # re-raised with the path: the folder is truncated or corrupt
            raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {one_line(e)}); it is "
                                  "truncated or corrupt: resume from another step (train.resume=<step>)") from e
        if saved_tree is None:
            raise CheckpointError(f"{where}: the state item has no metadata; the folder is incomplete")
        dropped = _dropped_fields(saved_tree, target_state)
        check_shapes(saved_tree, target_state, where, ignore=tuple(dropped))
        target = abstract_like(target_state)
        if dropped:  # restore into a tree with the old fields, then leave them out
            log.info("checkpoint: %s holds %s, which this version no longer keeps; skipped", where, sorted(dropped))
            replicated = next(x.sharding for x in jax.tree.leaves(target) if len(x.shape) == 0)  # e.g. step
            target = {**{f.name: getattr(target, f.name) for f in dataclasses.fields(target)},
                      **{k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=replicated)
                         for k, m in dropped.items()}}
        items = {STATE: ocp.args.StandardRestore(target)}
        has_data = (path / DATA).is_dir()
        if has_data:
            items[DATA] = DataStateRestore()
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where} cannot be restored ({type(e).__name__}: {one_line(e)}); it is "
                                  "truncated or corrupt: resume from another step (train.resume=<step>)") from e
        state = out[STATE]
        if dropped:
            state = dataclasses.replace(target_state, **{k: v for k, v in state.items() if k not in dropped})
        return Restored(state=state, data=out[DATA] if has_data else None, meta=meta, step=step, path=path)


def _params_metadata(step_dir: Path) -> Any:
    """Array metadata of the params: the `params` item, or the `params` subtree of a training `state`."""
    item = step_dir / PARAMS if (step_dir / PARAMS).is_dir() else step_dir / STATE
    md = ocp.PyTreeCheckpointer().metadata(item)
    tree = md.item_metadata.tree if hasattr(md, "item_metadata") else getattr(md, "tree", md)
    return tree if item.name == PARAMS else tree["params"]


def numpy_params(step_dir: Path) -> Any:
    """The parameters of a checkpoint as host numpy arrays, whatever mesh wrote them (no optimizer state
    is read from a training checkpoint: a partial restore of its `params` subtree)."""
    step_dir = Path(step_dir)
    tree = _params_metadata(step_dir)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                        is_leaf=lambda x: hasattr(x, "shape"))
    try:
        if (step_dir / PARAMS).is_dir():
            return ocp.PyTreeCheckpointer().restore(step_dir / PARAMS, args=ocp.args.PyTreeRestore(
                item=tree, restore_args=args))
        out = ocp.PyTreeCheckpointer().restore(step_dir / STATE, args=ocp.args.PyTreeRestore(
            item={"params": tree}, restore_args={"params": args}, partial_restore=True))
    except Exception as e:
        raise CheckpointError(f"checkpoint {step_dir} cannot be read ({type(e).__name__}: {one_line(e)}); it is "
                              "truncated or corrupt") from e
    return out["params"]


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints").expanduser().absolute()


# ------------------------------------------------------------------------------------------------
# train.resume


def find_resume(cfg: Config, own: Checkpointer | None) -> tuple[Checkpointer, int] | None:
    """Which checkpoint `train.resume` asks for: (a checkpointer to read it, step), or None = fresh start.

    `own` is this run's checkpointer (None when checkpoint.enabled=false). Refuses, instead of silently
    overwriting, a fresh start into a folder that already holds checkpoints.
    """
    resume = cfg.train.resume
    own_dir = checkpoint_dir(cfg)
    if own is not None:
        reader = own
    elif own_dir.is_dir():
        reader = Checkpointer(own_dir, read_only=True)
    else:
        reader = None
    own_steps = reader.all_steps() if reader is not None else []
    if resume == "never":
        if own_steps and own is not None:
            raise CheckpointError(
                f"train.resume=never but {own_dir} already holds checkpoints (steps {own_steps}); use "
                "train.resume=auto to continue, or a new checkpoint.dir / train.output_dir to start over")
        return None
    if resume == "auto":
        return (reader, own_steps[-1]) if own_steps else None
    if isinstance(resume, int) or str(resume).isdigit():
        step = int(resume)
        if step not in own_steps:
            raise CheckpointError(f"train.resume={step}: {own_dir} has no complete checkpoint for step {step}; "
                                  f"available steps: {own_steps or 'none'}")
        later = [s for s in own_steps if s > step]
        if later and own is not None:
            raise CheckpointError(
                f"train.resume={step} but {own_dir} also holds later steps {later}, which this run would "
                "overwrite; continue in a new checkpoint.dir (and point train.resume at this folder's path)")
        return reader, step
    path = Path(str(resume)).expanduser().absolute()
    found = _resume_path(resume, path)
    if found[0].is_params_only(found[1]) and own_steps:
        # Weights to *start* from: once this run has its own checkpoints, a restart continues from those.
        log.info("train.resume=%s holds initial weights, but %s already has step %d: continuing from it",
                 resume, own_dir, own_steps[-1])
        return reader, own_steps[-1]
    return found


def _resume_path(resume: str | int, path: Path) -> tuple[Checkpointer, int]:
    if not path.exists():
        raise CheckpointError(f"train.resume={resume}: {path} does not exist; pass auto, never, a step, or "
                              "an existing checkpoint folder")
    if is_step_dir(path):
        root, step = path.parent, int(path.name)
        source = Checkpointer(root, read_only=True)
        if step not in source.all_steps():
            raise CheckpointError(f"train.resume={resume}: {path} is not a complete checkpoint; complete steps "
                                  f"in {root}: {source.all_steps() or 'none'}")
        return source, step
    source = Checkpointer(path, read_only=True)
    steps = source.all_steps()
    if not steps:
        raise CheckpointError(f"train.resume={resume}: {path} holds no complete checkpoint (no <step>/meta "
                              "folders); pass a checkpoint folder written by mmjax")
    return source, steps[-1]


def check_data_compatible(meta: dict[str, Any], cfg: Config, where: str) -> None:
    """The loader state fits the process count and batch size it was written with; any worker count
    resumes it exactly (workers only encode records; the main process packs and batches in stream order)."""
    saved_pc = meta.get("process_count")
    if saved_pc != jax.process_count():
        raise CheckpointError(
            f"{where}: its data state is for {saved_pc} process(es) but this run has {jax.process_count()}; "
            f"resume with {saved_pc} process(es) (the device mesh may differ)")
    saved_gbs = meta.get("data", {}).get("global_batch_size")
    if saved_gbs != cfg.train.global_batch_size:
        raise CheckpointError(
            f"{where}: its data position counts batches of {saved_gbs} rows but train.global_batch_size="
            f"{cfg.train.global_batch_size}; set train.global_batch_size={saved_gbs}")
