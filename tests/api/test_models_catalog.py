"""ModelCatalog without an engine: which model strings a caller may use, where they resolve, what they list.

Model directories here hold only a `config.json` (the catalog never reads weights); uploads come through
the `find_upload(owner, name)` hook the upload store provides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import HTTPException

from tx.api.models import ModelCatalog, ModelRules, default_allow
from tx.api.validate import ValidationError
from tx.protocol import ModelInfo

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 96,
}  # fmt: skip


def _model_dir(root: Path, name: str, config: dict) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_loopback_allows_any_model_and_other_addresses_only_the_preloaded() -> None:
    assert default_allow("127.0.0.1", ["a/b"]) is None
    assert default_allow("0.0.0.0", ["a/b", "/m"]) == ("a/b", "/m")
    assert default_allow("10.1.2.3", []) == ()


def test_allow_globs_refuse_other_strings_but_not_preloaded_models(tmp_path: Path) -> None:
    inside, outside = _model_dir(tmp_path, "ok/one", QWEN3), _model_dir(tmp_path, "other", QWEN3)
    catalog = ModelCatalog(ModelRules(allow=(f"{tmp_path}/ok/*",), max_seq_len=4096))
    assert catalog.get("alice", str(inside)).model_dir == str(inside)
    with pytest.raises(HTTPException) as refused:
        catalog.get("alice", str(outside))
    assert refused.value.status_code == 403 and f"--allow-models {tmp_path}/ok/*" in refused.value.detail
    catalog.preload(str(outside))  # named on the command line: allowed whatever the globs say
    assert catalog.get("alice", str(outside)).info.vocab_size == 300


def test_a_glob_does_not_let_dot_dot_climb_out_of_its_directory(tmp_path: Path) -> None:
    """fnmatch's `*` matches "/" and "..": `<root>/ok/*` matched `<root>/ok/../secret`, a directory the globs
    never allowed (another tenant's full fine-tuning export under the data directory, say)."""
    _model_dir(tmp_path, "ok/one", QWEN3)
    _model_dir(tmp_path, "secret", QWEN3)
    catalog = ModelCatalog(ModelRules(allow=(f"{tmp_path}/ok/*",), max_seq_len=4096))
    for sneaky in (f"{tmp_path}/ok/../secret", f"{tmp_path}/ok/one/../../secret", f"{tmp_path}/ok/one/.."):
        with pytest.raises(ValidationError, match="has a '..' part"):
            catalog.get("alice", sneaky)
    assert catalog.get("alice", f"{tmp_path}/ok/one").info.vocab_size == 300


def test_uploads_are_private_to_their_owner_even_once_loaded(tmp_path: Path) -> None:
    mine = _model_dir(tmp_path, "store/alice/mine", QWEN3)
    uploads = {("alice", "upload:mine"): mine}
    loaded: dict[str, ModelInfo] = {}
    catalog = ModelCatalog(
        ModelRules(allow=()),  # nothing may be loaded on demand, except uploads by their owner
        lambda: loaded,
        find_upload=lambda owner, name: uploads.get((owner, name)),
        list_uploads=lambda owner: [n for o, n in uploads if o == owner],
    )
    served = catalog.get("alice", "upload:mine")
    assert served.model_dir == str(mine) and served.owner == "alice"
    with pytest.raises(HTTPException) as missing:
        catalog.get("bob", "upload:mine")
    assert missing.value.status_code == 404 and "no upload by that name" in missing.value.detail
    loaded[str(mine)] = served.info
    assert [m.info.base_model for m in catalog.usable("alice")] == ["upload:mine"]
    assert catalog.usable("bob") == [] and catalog.usable(None) == []


def test_an_upload_deleted_or_sent_again_elsewhere_is_not_served_from_memory(tmp_path: Path) -> None:
    """The catalog remembers a model once described; only the API process that deleted an upload forgot it.
    Behind a load balancer, another process kept serving the deleted upload, and after a new upload under the
    name it handed new runs the old weights. A remembered upload is checked against the store each time."""
    first = _model_dir(tmp_path, "store/alice/mine/model-1", QWEN3)
    second = _model_dir(tmp_path, "store/alice/mine/model-2", QWEN3)
    uploads = {("alice", "upload:mine"): first}
    catalog = ModelCatalog(ModelRules(allow=()), find_upload=lambda owner, name: uploads.get((owner, name)))
    assert catalog.get("alice", "upload:mine").model_dir == str(first)
    del uploads[("alice", "upload:mine")]  # deleted through another API process
    with pytest.raises(HTTPException) as gone:
        catalog.get("alice", "upload:mine")
    assert gone.value.status_code == 404
    uploads[("alice", "upload:mine")] = second  # and sent again
    assert catalog.get("alice", "upload:mine").model_dir == str(second)


def test_clients_get_a_tokenizer_name_they_can_resolve_never_an_uploads_server_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`get_info().tokenizer_id` goes to the SDK's `AutoTokenizer.from_pretrained` on the client's machine:
    an upload gives the hub name its files record, else its own model string; a local directory its absolute path."""
    recorded = _model_dir(tmp_path, "store/alice/tuned", {**QWEN3, "_name_or_path": "Qwen/Qwen3-8B"})
    (recorded / "tokenizer_config.json").write_text(json.dumps({"name_or_path": "Qwen/Qwen3-8B-Base"}))
    bare = _model_dir(tmp_path, "store/alice/bare", {**QWEN3, "_name_or_path": "/home/alice/ckpt"})
    local = _model_dir(tmp_path, "local", QWEN3)
    uploads = {("alice", "upload:tuned"): recorded, ("alice", "upload:bare"): bare}
    catalog = ModelCatalog(ModelRules(), find_upload=lambda owner, name: uploads.get((owner, name)))
    assert catalog.get("alice", "upload:tuned").info.tokenizer_id == "Qwen/Qwen3-8B-Base"
    assert catalog.get("alice", "upload:bare").info.tokenizer_id == "upload:bare"
    assert catalog.get("alice", str(local)).info.tokenizer_id == str(local)
    monkeypatch.chdir(tmp_path)  # a client elsewhere cannot resolve the server's `./local`
    assert catalog.get("alice", "./local").info.tokenizer_id == str(local.absolute())
    (recorded / "tokenizer_config.json").unlink()
    catalog.forget_upload("alice", "upload:tuned")
    assert catalog.get("alice", "upload:tuned").info.tokenizer_id == "Qwen/Qwen3-8B"


def test_loaded_models_are_listed_with_their_context_length(tmp_path: Path) -> None:
    pre, extra = _model_dir(tmp_path, "pre", QWEN3), _model_dir(tmp_path, "extra", QWEN3)
    loaded: dict[str, ModelInfo] = {}
    catalog = ModelCatalog(ModelRules(max_seq_len=64), lambda: loaded)
    catalog.preload(str(pre))
    served = catalog.get("alice", str(extra))
    assert [m.info.base_model for m in catalog.usable("bob")] == [str(pre)]  # resolved, not loaded yet
    loaded[served.model_dir] = served.info
    listed = {m.info.base_model: m.info.max_seq_len for m in catalog.usable("bob")}
    assert listed == {str(pre): 64, str(extra): 64}
    # Other spellings of a loaded model's directory name the same copy: it is listed once, as first asked for.
    for spelling in (f"{extra}/", f"{tmp_path}/./extra", f"{pre}/"):
        catalog.get("carol", spelling)
    assert sorted(m.info.base_model for m in catalog.usable("bob")) == sorted([str(pre), str(extra)])
    long = _model_dir(tmp_path, "long", QWEN3)
    assert ModelCatalog(ModelRules(max_seq_len=4096)).get("a", str(long)).info.max_seq_len == 96


def test_unknown_and_unsupported_models_are_clear_errors(tmp_path: Path) -> None:
    catalog = ModelCatalog(ModelRules())
    with pytest.raises(HTTPException) as missing:
        catalog.get("alice", str(tmp_path / "nowhere"))
    assert missing.value.status_code == 404 and "no model directory at" in missing.value.detail
    gpt2 = _model_dir(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValidationError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: .*Qwen3"):
        catalog.get("alice", str(gpt2))
    with pytest.raises(HTTPException) as offline:
        catalog.get("alice", "tiny-org/not-in-the-cache")  # tests run with HF_HUB_OFFLINE=1
    assert offline.value.status_code == 404 and "not in the HF cache" in offline.value.detail


def test_a_catalog_of_one_model_refuses_every_other_name() -> None:
    info = ModelInfo("smolgym/tiny", vocab_size=10, max_seq_len=8, tokenizer_id="gpt2")
    catalog = ModelCatalog.single(info)
    assert catalog.get("alice", "smolgym/tiny").info == info
    with pytest.raises(ValidationError, match="unknown base_model 'x/y'; this server serves 'smolgym/tiny'"):
        catalog.get("alice", "x/y")


def test_a_hub_model_with_only_its_config_cached_is_left_to_the_engine_to_fetch(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The catalog needs only `config.json`: a hub model whose weights are not cached is keyed by its name,
    and the engine's fetcher downloads the weights (`locate_model`, which refuses a config-only snapshot)."""
    import huggingface_hub.constants

    from tx.models.catalog import locate_model

    snapshot = _model_dir(tmp_path / "hub" / "models--org--big" / "snapshots", "3" * 40, QWEN3)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("3" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    served = ModelCatalog(ModelRules()).get("alice", "org/big")
    assert served.model_dir == "org/big" and served.info.vocab_size == 300
    with pytest.raises(FileNotFoundError, match="not in the HF cache .*`hf download org/big`"):
        locate_model("org/big")  # offline, and the cache holds no weights
    (snapshot / "model.safetensors").write_bytes(b"")
    assert locate_model("org/big") == snapshot
    assert ModelCatalog(ModelRules()).get("alice", "org/big").model_dir == str(snapshot)


def test_a_hub_model_named_at_start_is_checked_from_its_config_before_its_weights_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--base-model org/x`: the architecture and the memory budget are read from `config.json`, and the
    weights fetched only then; the whole checkpoint was downloaded first, then refused."""
    import huggingface_hub.constants

    from tx.engine.build import estimate_bytes
    from tx.engine.errors import RequestError
    from tx.engine.pool import ModelPool

    for name, config in (("big", QWEN3), ("odd", {**QWEN3, "architectures": ["MistralForCausalLM"]})):
        snapshot = _model_dir(tmp_path / "hub" / f"models--org--{name}" / "snapshots", "3" * 40, config)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("3" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fetched: list[str] = []

    def pool(budget: int) -> ModelPool:
        return ModelPool(
            None, lambda d: estimate_bytes(d, "float32", 2), budget, locate=lambda n: fetched.append(n) or tmp_path
        )  # type: ignore[arg-type, func-returns-value]

    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelCatalog(ModelRules()).preload("org/odd", pool(1 << 40).fetch_within_budget)
    with pytest.raises(RequestError, match="more than the memory budget"):
        ModelCatalog(ModelRules()).preload("org/big", pool(1000).fetch_within_budget)
    assert fetched == []
    assert ModelCatalog(ModelRules()).preload("org/big", pool(1 << 40).fetch_within_budget).model_dir == str(tmp_path)
    assert fetched == ["org/big"]
    assert ModelCatalog(ModelRules()).preload("org/big").info.vocab_size == 300  # --role api: no weights fetched
    assert fetched == ["org/big"]


def test_no_base_model_names_a_directory_in_the_data_directory(tmp_path: Path) -> None:
    """Another tenant's full fine-tuning checkpoint is a model directory under the data directory: named by
    path (directly, through a symlink, or with `~`), it is refused before anything reads it; its owner names
    it by tinker:// path. Directories elsewhere still load."""
    data = tmp_path / "data"
    theirs = _model_dir(data, "checkpoints/run_1/sampler_weights/s1", QWEN3)
    (tmp_path / "link").symlink_to(theirs)
    mine = _model_dir(tmp_path, "models/mine", QWEN3)
    catalog = ModelCatalog(ModelRules(private=(str(data),)))
    for name in (str(theirs), str(tmp_path / "link"), str(data / "checkpoints/run_1/../run_1/sampler_weights/s1")):
        with pytest.raises((HTTPException, ValidationError)) as err:
            catalog.get("mallory", name)
        assert not isinstance(err.value, HTTPException) or err.value.status_code == 403
    with pytest.raises(HTTPException, match="data directory") as denied:
        catalog.get("mallory", str(tmp_path / "link"))
    assert denied.value.status_code == 403
    assert catalog.get("mallory", str(mine)).info.base_model == str(mine)
    assert ModelCatalog(ModelRules()).get("alice", str(theirs)).info.base_model == str(theirs)  # no data dir given
