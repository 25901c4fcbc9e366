"""What a registration stores: one file per model or dataset, and a model's transformers config read from a
folder's config.json or from a GGUF file's metadata (no weights loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apiary.registry import RegistryError, Upload, dataset_upload, hf_config, model_key, model_upload


def _gguf(path: Path) -> Path:
    """A tiny llama GGUF file: the architecture in its metadata, one small tensor."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(16)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_registered_with_the_architecture_from_its_metadata(tmp_path: Path) -> None:
    upload = model_upload(_gguf(tmp_path / "tiny.gguf"), tmp_path)

    config = hf_config(upload)

    assert (upload.format, upload.name, model_key(7, upload)) == ("gguf", "tiny", "models/7/tiny.gguf")
    assert config is not None and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (32, 2, 2)


def test_a_model_folder_is_zipped_with_its_config(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "out").mkdir()

    upload = model_upload(folder, tmp_path / "out", name="mine")

    assert (upload.format, upload.name, model_key(3, upload)) == ("hf", "mine", "models/3/model.zip")
    assert hf_config(upload) == {"model_type": "llama"}


def test_a_safetensors_checkpoint_has_no_transformers_config(tmp_path: Path) -> None:
    (tmp_path / "w.safetensors").write_bytes(b"x")

    upload = model_upload(tmp_path / "w.safetensors", tmp_path)

    assert upload.format == "safetensors" and hf_config(upload) is None


@pytest.mark.parametrize("name", ["notes.txt", "folder"])
def test_what_is_no_model_is_refused_in_one_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.mkdir() if name == "folder" else path.write_text("x")

    with pytest.raises(RegistryError) as refused:
        model_upload(path, tmp_path)

    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_a_truncated_gguf_file_is_refused(tmp_path: Path) -> None:
    data = _gguf(tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])

    with pytest.raises(RegistryError, match=r"cut\.gguf is not a GGUF model"):
        hf_config(Upload(tmp_path / "cut.gguf", "cut", "gguf"))


def test_a_jsonl_dataset_is_stored_as_it_is_and_a_folder_zipped(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "d.jsonl").write_text('{"text": "a"}\n')

    assert dataset_upload(tmp_path / "d.jsonl", tmp_path) == Upload(tmp_path / "d.jsonl", "d")
    assert dataset_upload(tmp_path / "folder", tmp_path).file == tmp_path / "folder.zip"
