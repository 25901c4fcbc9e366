"""What the operator's policy lets a job reach, and how big another party's input may be."""

from __future__ import annotations

import io
import re
import stat
import zipfile
from pathlib import Path

import pytest

from apiary.contracts import DecodeError, decode_body
from apiary.dataset import DatasetError, DatasetSource, Manifest, extract_shard
from apiary.jobspec import JobSpec, policy_errors
from apiary.policy import LIMITS, Limits, Policy, Refused, check_zip, entrypoint_error, job_errors, path_error
from apiary.safetensors_header import WeightsError, read_header


def test_an_entrypoint_runs_only_if_a_pattern_allows_it_and_never_from_the_standard_library() -> None:
    allowed = ("examples.*", "team.train:fl_train_model")

    assert entrypoint_error("examples.digits.train:fl_train_model", allowed) is None
    assert entrypoint_error("team.train:fl_train_model", allowed) is None
    assert entrypoint_error(None, allowed) is None  # a built-in trainer
    assert entrypoint_error("mine.train:fit", allowed, bundled=True) is None  # its code bundle's own module
    assert "is not allowed here (APIARY_ALLOWED_ENTRYPOINTS: examples.*, team.train:fl_train_model)" in (
        entrypoint_error("team.train:other", allowed) or "")
    assert entrypoint_error("os:system", ("*",)) == "'os:system' is a standard-library module, not training code"
    assert entrypoint_error("subprocess:run", allowed, bundled=True) is not None


def test_local_paths_must_lie_under_a_data_root_after_links_are_followed(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "digits").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    policy = Policy(data_roots=(root,))

    assert path_error(str(root / "digits"), policy) is None
    assert path_error(f"file://{root}/digits", policy) is None
    assert path_error("s3://bucket/runs/datasets/x.zip", policy) is None  # not a local path
    assert path_error("/etc", policy) == (f"/etc is outside the folders local data may be read from ({root};"
                                          " APIARY_DATA_ROOTS): register it, or ask the operator to allow its folder")
    assert path_error(str(root / "digits" / ".." / ".." / "x"), policy) is not None
    assert path_error(str(root / "escape" / "passwd"), policy) is not None


def test_a_request_names_each_refused_field(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"name": "n", "entrypoint": "os:system", "dataset": "/etc", "model": "/root/m"})

    errors = policy_errors(spec, Policy(data_roots=(tmp_path,)))

    assert [e.field for e in errors] == ["entrypoint", "dataset", "model"]
    assert job_errors({"entrypoint": "examples.x:f", "dataset": str(tmp_path)}, Policy(data_roots=(tmp_path,))) == []


def _zip(members: dict[str, bytes], *, symlink: str | None = None, deflate: bool = False) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/etc/passwd")
    return buffer.getvalue()


def _check(data: bytes, limits: Limits = LIMITS) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        check_zip(zf, "dataset d.zip", len(data), limits)


def test_zips_with_escaping_members_links_bombs_or_too_many_members_are_refused() -> None:
    small = Limits(zip_members=3, ratio_floor=1000, zip_ratio=50)

    _check(_zip({"manifest.json": b"{}", "a/b.txt": b"x"}), small)
    with pytest.raises(Refused, match=re.escape("member '../evil' must stay inside the archive")):
        _check(_zip({"../evil": b"x"}))
    with pytest.raises(Refused, match="member '/abs' must stay inside"):
        _check(_zip({"/abs": b"x"}))
    with pytest.raises(Refused, match="member 'link' is a symbolic link"):
        _check(_zip({}, symlink="link"))
    with pytest.raises(Refused, match="4 members, over the limit of 3"):
        _check(_zip({f"{i}": b"x" for i in range(4)}), small)
    with pytest.raises(Refused, match=re.escape("past the ratio limit of 50 (a zip bomb")):
        _check(_zip({"zeros": bytes(100_000)}, deflate=True), small)


def test_a_dataset_zip_bomb_is_refused_before_anything_is_unpacked(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.zip"
    bomb.write_bytes(_zip({"manifest.json": b'{"samples": [{"path": "z"}]}', "z": bytes(64 * 1024 * 1024)},
                          deflate=True))

    with pytest.raises(DatasetError, match="zip bomb"):
        DatasetSource(bomb)
    with pytest.raises(DatasetError, match="zip bomb"):
        extract_shard(bomb, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_manifests_headers_and_messages_past_their_bounds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("apiary.dataset.LIMITS", Limits(manifest_entries=2))
    monkeypatch.setattr("apiary.safetensors_header.LIMITS", Limits(tensors=1))
    header = b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},' \
             b' "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'

    with pytest.raises(DatasetError, match="lists 3 entries, over the limit of 2"):
        Manifest.parse(b'{"samples": [{"path": "a"}, {"path": "b"}, {"path": "c"}]}', "d")
    with pytest.raises(WeightsError, match="lists 2 tensors, over the limit of 1"):
        read_header(len(header).to_bytes(8, "little") + header)
    with pytest.raises(DecodeError, match="over the limit"):
        decode_body(bytes(LIMITS.message_bytes + 1))
    with pytest.raises(WeightsError, match="not JSON"):
        deep = b"[" * 100_000
        read_header(len(deep).to_bytes(8, "little") + deep)
