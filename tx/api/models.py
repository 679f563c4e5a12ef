"""Which base models a caller may use, where their files are, and what the API validates them with.

`ModelCatalog.get(owner, name)` turns a client's model string into a `ServedModel` (its `ModelInfo`,
the directory the engine loads it from, and its request limits), or raises a 4xx naming the problem.
Order: an upload of the caller (`upload:NAME`, through the upload store's `find_upload(owner, name)`
hook; uploads are private to their owner), a local directory, the local HF cache, the hub when it is
reachable. `--allow-models` globs decide which strings may be loaded at all (uploads are always allowed
to their owner, preloaded models to everyone). Nothing here loads a model: the engine does, on the
first request that needs it (`tx.engine.pool`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NoReturn

from fastapi import HTTPException

from tx.api.limits import Limits, limits_for
from tx.api.validate import ValidationError
from tx.models.catalog import describe_model, has_weights, is_hub_name, locate_config, split_variant
from tx.protocol import ModelInfo

UPLOAD_PREFIX = "upload:"
FindUpload = Callable[[str, str], Path | None]  # (owner, model string) -> an upload's directory, or None
ListUploads = Callable[[str], list[str]]  # owner -> the model strings of their uploads
Loaded = Callable[[], Mapping[str, ModelInfo]]  # model directory -> info of the models loaded now


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    # The engine's key: the directory of the weights, or the hub name when they still have to be downloaded
    # ("" for a catalog that serves one fixed model).
    model_dir: str
    limits: Limits
    owner: str | None = None  # an upload's owner; None: any caller may see it


@dataclass(frozen=True)
class ModelRules:
    """`allow`: globs over model strings (None: any model); the rest shapes each model's `ModelInfo`."""

    allow: tuple[str, ...] | None = None
    max_seq_len: int = 4096
    max_lora_rank: int = 128
    max_lora_adapters: int = 8
    private: tuple[str, ...] = ()  # directories no base_model may name (the data directory: every tenant's files)


def default_allow(host: str, base_models: Sequence[str]) -> tuple[str, ...] | None:
    """Any model when the server listens on loopback only; otherwise only the preloaded ones (and uploads)."""
    return None if host in ("127.0.0.1", "localhost", "::1") else tuple(base_models)


class ModelCatalog:
    def __init__(
        self,
        rules: ModelRules,
        loaded: Loaded = dict,
        find_upload: FindUpload | None = None,
        list_uploads: ListUploads | None = None,
    ) -> None:
        self.rules, self.loaded = rules, loaded
        self.find_upload, self.list_uploads = find_upload, list_uploads
        self.preloaded: dict[str, ServedModel] = {}
        self._known: dict[tuple[str | None, str], ServedModel] = {}
        self._lock = threading.Lock()
        self.fixed = False
        self.only_preloaded = ""  # why no other model may be named (an engine over several processes), or ""

    @classmethod
    def single(cls, info: ModelInfo) -> ModelCatalog:
        """A catalog of one model known only by its name (tests with a fake engine)."""
        catalog = cls(ModelRules(allow=(info.base_model,)))
        catalog.add(ServedModel(info, "", limits_for(info)))
        catalog.fixed = True
        return catalog

    def add(self, model: ServedModel) -> None:
        """A preloaded model: visible to everyone, always allowed."""
        self.preloaded[model.info.base_model] = model
        self._known[(None, model.info.base_model)] = model

    def preload(self, name: str, fetch: Callable[[str, Path], Path] | None = None) -> ServedModel:
        """Locate and describe a model named on the command line from its `config.json` alone (raises
        FileNotFoundError or ValueError): an unsupported architecture is refused before any weight is
        downloaded. `fetch(name, config_dir)` gives the directory with its weights (the engine's pool, which
        sizes the model from the config first); without it (`--role api`) no weight is fetched."""
        config_dir = locate_config(name)
        r = self.rules
        info = describe_model(name, config_dir, r.max_seq_len, r.max_lora_rank, r.max_lora_adapters)
        model_dir = fetch(name, config_dir) if fetch is not None else config_dir
        model = ServedModel(info, str(model_dir), limits_for(info))
        self.add(model)
        return model

    def get(self, owner: str, name: str) -> ServedModel:
        """The model `name` as `owner` may use it, located and described once and then remembered. A variant
        (`org/model:peft:<context>`) is its hub model, its context capped; `info.base_model` names the hub model,
        which is what the engine loads."""
        base, context = split_variant(name)
        if base != name:
            hub = self.get(owner, base)
            info = dataclasses.replace(hub.info, max_seq_len=min(hub.info.max_seq_len, context or 1 << 62))
            return dataclasses.replace(hub, info=info, limits=limits_for(info))
        is_upload = name.startswith(UPLOAD_PREFIX)
        key = (owner if is_upload else None, name)
        with self._lock:
            known = self._known.get(key)
        if known is not None and (not is_upload or self._still_uploaded(owner, name, known)):
            return known
        if self.fixed or self.only_preloaded:
            served = ", ".join(repr(n) for n in self.preloaded)
            why = f" ({self.only_preloaded})" if self.only_preloaded else ""
            raise ValidationError(f"unknown base_model {name!r}; this server serves {served}{why}")
        if ".." in PurePosixPath(name).parts:  # an --allow-models glob's * spans "/": /models/* matched /models/../x
            raise ValidationError(f"base_model {name!r} has a '..' part; name the model's directory directly")
        if not is_upload and not self._allowed(name):
            raise HTTPException(
                403, detail=f"base_model {name!r} is not allowed on this server (--allow-models {self._allow_text()})"
            )
        if not is_upload:
            self._refuse_private(name, Path(name).expanduser())  # as named (a hub name reads as a relative path)
        model_dir = self._locate_config(owner, name, is_upload)
        if not is_upload:
            self._refuse_private(name, model_dir)  # as found: through symlinks, a hub cache, `~`
        model = self._describe(owner if is_upload else None, name, model_dir)
        with self._lock:
            self._known[key] = model
        return model

    def _still_uploaded(self, owner: str, name: str, known: ServedModel) -> bool:
        """Whether the upload remembered is still the one on disk (one `upload.json` read): another API process
        may have deleted it, or it was deleted and sent again, and its new runs trained the old weights."""
        found = self.find_upload(owner, name) if self.find_upload is not None else None
        return found is not None and str(found) == known.model_dir

    def forget_upload(self, owner: str, name: str) -> None:
        """Drop what `get` remembered of `owner`'s upload `name` (deleted: a later request must not find it)."""
        with self._lock:
            self._known.pop((owner, name), None)

    def _refuse_private(self, name: str, path: Path) -> None:
        """403 when `path`, resolved, lies in one of `rules.private`: the data directory holds every tenant's
        checkpoints and uploads, which each owner names by tinker:// path or upload:NAME, never by path."""
        where = path.resolve()
        if any(where.is_relative_to(Path(root).resolve()) for root in self.rules.private):
            raise HTTPException(
                403,
                detail=f"base_model {name!r} names a directory in this server's data directory: name a checkpoint "
                "by its tinker:// path (create from state or a sampler path) or an upload as upload:NAME",
            )

    def _allowed(self, name: str) -> bool:
        patterns = self.rules.allow
        return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)

    def _allow_text(self) -> str:
        return " ".join(self.rules.allow or ("*",))

    def _locate_config(self, owner: str, name: str, is_upload: bool) -> Path:
        """The directory of the model's `config.json`: for a hub name not in the cache, a snapshot with the
        config alone (the engine downloads the weights when it loads the model)."""
        found = self.find_upload(owner, name) if self.find_upload is not None else None
        if found is not None:
            return found
        if is_upload:
            _not_found(f"unknown base_model {name!r}: you have no upload by that name")
        try:
            return locate_config(name)
        except FileNotFoundError as err:
            _not_found(f"unknown base_model {name!r}: {err}")

    def _describe(self, owner: str | None, name: str, model_dir: Path) -> ServedModel:
        r = self.rules
        try:
            private = owner is not None  # an upload: its directory is the server's own
            info = describe_model(name, model_dir, r.max_seq_len, r.max_lora_rank, r.max_lora_adapters, private)
        except FileNotFoundError as err:
            _not_found(f"base_model {name!r} has no usable model files: {err}")
        except (ValueError, KeyError) as err:  # unsupported architecture (with the list) or a broken config
            raise ValidationError(f"base_model {name!r} cannot be served: {err}") from err
        fetch = is_hub_name(name) and not has_weights(model_dir)  # weights not cached: the engine downloads them
        engine_key = name if fetch else str(model_dir)
        return ServedModel(info, engine_key, limits_for(info), owner)

    def usable(self, owner: str | None) -> list[ServedModel]:
        """What a caller can use now: preloaded models, models loaded on demand (other owners' uploads
        excepted) and the caller's own uploads."""
        loaded = self.loaded()
        with self._lock:
            known = list(self._known.values())
        models = {m.info.base_model: m for m in self.preloaded.values()}
        listed = {m.model_dir for m in models.values()}
        for m in known:  # one entry a loaded copy: `dir`, `dir/` and `./dir` name one (the first asked for)
            if m.model_dir in loaded and m.owner is None and m.model_dir not in listed:
                models.setdefault(m.info.base_model, m)
                listed.add(m.model_dir)
        if owner is not None and self.list_uploads is not None:
            for name in self.list_uploads(owner):
                try:
                    models.setdefault(name, self.get(owner, name))
                except (HTTPException, ValidationError):
                    continue  # an upload that cannot be served is not listed
        return list(models.values())


def _not_found(message: str) -> NoReturn:
    raise HTTPException(404, detail=message)
