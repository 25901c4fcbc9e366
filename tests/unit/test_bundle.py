"""Code bundles: deterministic packing, what is left out, and every kind of bad zip refused in one line."""

from __future__ import annotations

import io
import os
import stat
import zipfile
from pathlib import Path

import pytest

from apiary import bundle
from apiary.bundle import IgnoreRules, Limits


def _project(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "train.py").write_text("def fl_train_model(p, o, l=None):\n    return {}\n")
    (root / "README.md").write_text("hello\n")
    return root


def _zip(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for info, data in entries:
            zf.writestr(info, data)
    return buffer.getvalue()


def test_same_folder_packs_to_the_same_sha256_twice(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")

    first = bundle.pack(root)
    os.utime(root / "pkg" / "train.py", (1, 1))  # times and modes never reach the zip
    (root / "README.md").chmod(0o600)
    second = bundle.pack(root)

    assert first.sha256 == second.sha256
    assert first.data == second.data
    assert first.files == ["README.md", "pkg/__init__.py", "pkg/train.py"]


def test_a_changed_file_changes_the_sha256(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    before = bundle.pack(root).sha256

    (root / "pkg" / "train.py").write_text("# v2\n")

    assert bundle.pack(root).sha256 != before


def test_entries_are_sorted_with_fixed_times_and_modes(tmp_path: Path) -> None:
    packed = bundle.pack(_project(tmp_path / "proj"))

    with zipfile.ZipFile(io.BytesIO(packed.data)) as zf:
        infos = zf.infolist()

    assert [i.filename for i in infos] == sorted(i.filename for i in infos)
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert {i.external_attr >> 16 for i in infos} == {0o100644}


def test_git_pycache_venv_big_files_and_ignored_ones_are_left_out(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    for folder in (".git", "pkg/__pycache__", ".venv/lib"):
        (root / folder).mkdir(parents=True)
        (root / folder / "x.py").write_text("x")
    (root / "big.bin").write_bytes(b"0" * 2048)
    (root / "data").mkdir()
    (root / "data" / "a.csv").write_text("1")
    (root / "notes.log").write_text("log")
    (root / "pkg" / "keep.log").write_text("log")
    (root / ".apiaryignore").write_text("# comment\n/data/\n*.log\n")
    (root / "link.py").symlink_to(root / "pkg" / "train.py")

    packed = bundle.pack(root, Limits(file_bytes=1024))

    assert packed.files == [".apiaryignore", "README.md", "pkg/__init__.py", "pkg/train.py"]
    left = dict(packed.left_out)
    expected = {".git/", "pkg/__pycache__/", ".venv/", "data/", "notes.log", "pkg/keep.log", "link.py", "big.bin"}
    assert expected <= set(left)
    assert left["link.py"] == "symlink"
    assert "over the 1024-byte limit" in left["big.bin"]


@pytest.mark.parametrize(("pattern", "path", "is_dir", "expected"), [
    ("*.log", "a/b/c.log", False, True),
    ("/data/", "data", True, True),
    ("/data/", "sub/data", True, False),
    ("data/", "data", False, False),
    ("build", "x/build", True, True),
    ("docs/*.md", "docs/a.md", False, True),
    ("docs/*.md", "x/docs/a.md", False, False),
    ("**/secret.txt", "secret.txt", False, True),
    ("**/secret.txt", "a/b/secret.txt", False, True),
])
def test_ignore_patterns_read_like_gitignore(pattern: str, path: str, is_dir: bool, expected: bool) -> None:
    assert IgnoreRules([pattern]).matches(path, is_dir=is_dir) is expected


@pytest.mark.parametrize(("path", "is_dir", "expected"), [
    ("notes.log", False, True),
    ("keep.log", False, False),
    ("pkg/keep.log", False, False),
    ("data", True, False),
    ("data/a.csv", False, True),
    ("data/keep.csv", False, False),
    ("build", True, True),
    ("build", False, False),
    ("src/build", True, True),
])
def test_ignore_rules_take_paths_back_with_negation_and_match_folders(path: str, is_dir: bool,
                                                                        expected: bool) -> None:
    # Prepare
    rules = IgnoreRules(["*.log", "!keep.log", "data/*", "!data/keep.csv", "build/"])

    # Execute / Assert
    assert rules.matches(path, is_dir=is_dir) is expected


def test_a_negated_file_is_packed_but_not_from_a_folder_left_out(tmp_path: Path) -> None:
    # Prepare: as in git, `!` cannot take back a file whose folder is ignored.
    root = _project(tmp_path / "proj")
    for name in ("data/a.csv", "data/keep.csv", "cache/keep.csv", "notes.log", "keep.log"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    (root / ".apiaryignore").write_text("*.log\n!keep.log\ndata/*\n!data/keep.csv\ncache/\n!cache/keep.csv\n")

    # Execute
    packed = bundle.pack(root)

    # Assert
    assert "keep.log" in packed.files and "data/keep.csv" in packed.files
    assert {"notes.log", "data/a.csv", "cache/"} <= set(dict(packed.left_out))
    assert not any(name.startswith("cache/") for name in packed.files)


def test_a_zip_is_repacked_to_the_folder_bundle(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    folder = bundle.pack(root)
    user_zip = tmp_path / "code.zip"
    user_zip.write_bytes(_zip([(name, (root / name).read_bytes()) for name in reversed(folder.files)]))

    assert bundle.pack(user_zip).sha256 == folder.sha256


def test_an_empty_folder_or_missing_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        bundle.pack(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"neither a folder nor a \.zip"):
        bundle.pack(tmp_path / "nowhere")


def test_a_bundle_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    (root / "noise.bin").write_bytes(os.urandom(4096))

    with pytest.raises(ValueError, match="over the 2000-byte limit"):
        bundle.pack(root, Limits(bundle_bytes=2000))
    with pytest.raises(ValueError, match="over the 2000-byte limit"):
        bundle.inspect(bundle.pack(root).data, Limits(bundle_bytes=2000))


def _symlink_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize(("entries", "message"), [
    ([("/etc/passwd", b"x")], "is an absolute path"),
    ([("C:/x.py", b"x")], "is an absolute path"),
    ([("a/../../x.py", b"x")], "contains '..'"),
    ([("..\\x.py", b"x")], "contains '..'"),
    ([(_symlink_info("evil"), b"/etc/passwd")], "is a symlink"),
    ([("a.py", b"1"), ("a.py", b"2")], "lists 'a.py' twice"),
    ([("bomb.bin", b"\0" * (8 * 2**20))], "zip bomb"),
])
def test_bad_zips_are_refused_in_one_line(entries: list[tuple[zipfile.ZipInfo | str, bytes]], message: str) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name
        data = _zip(entries)

    with pytest.raises(ValueError, match=message) as error:
        bundle.inspect(data)

    assert "\n" not in str(error.value)


def test_not_a_zip_and_too_many_entries_are_refused() -> None:
    with pytest.raises(ValueError, match="not a valid zip"):
        bundle.inspect(b"PK\x03\x04 nonsense")
    with pytest.raises(ValueError, match="3 entries, over the limit of 2"):
        bundle.inspect(_zip([(f"{i}.py", b"") for i in range(3)]), Limits(entries=2))
    with pytest.raises(ValueError, match="unpacks to over 10 bytes"):
        bundle.inspect(_zip([("a.py", b"x" * 11)]), Limits(unpacked_bytes=10))


def test_verify_refuses_a_sha256_that_does_not_match(tmp_path: Path) -> None:
    packed = bundle.pack(_project(tmp_path / "proj"))

    assert bundle.verify(packed.data, packed.sha256).has_module("pkg.train")
    with pytest.raises(ValueError, match=r"sha256 is .*, not 000000000000"):
        bundle.verify(packed.data, "0" * 64)


def test_has_module_finds_modules_and_packages(tmp_path: Path) -> None:
    inspected = bundle.inspect(bundle.pack(_project(tmp_path / "proj")).data)

    assert inspected.has_module("pkg.train")
    assert inspected.has_module("pkg")
    assert not inspected.has_module("pkg.missing")
    assert not inspected.has_module("train")


def test_unpack_writes_read_only_files_and_replaces_a_partial_one(tmp_path: Path) -> None:
    packed = bundle.pack(_project(tmp_path / "proj"))
    archive = tmp_path / "b.zip"
    archive.write_bytes(packed.data)
    target = tmp_path / "out"

    bundle.unpack(archive, target)
    bundle.unpack(archive, target)  # again over a read-only folder

    assert (target / "pkg" / "train.py").read_text().startswith("def fl_train_model")
    assert stat.S_IMODE((target / "pkg" / "train.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((target / "pkg").stat().st_mode) == 0o555
    bundle.remove_tree(target)
    assert not target.exists()


def test_unpack_refuses_a_member_larger_than_it_declares(tmp_path: Path) -> None:
    data = bytearray(_zip([("a.py", b"x" * 1000)]))
    # Shrink the size the central directory declares (the local header's stays): the reader must count.
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = zf.getinfo("a.py")
    central = bytes(data).rindex(b"PK\x01\x02")
    size_at = central + 24
    data[size_at:size_at + 4] = (10).to_bytes(4, "little")
    archive = tmp_path / "lying.zip"
    archive.write_bytes(bytes(data))
    assert info.file_size == 1000

    with pytest.raises((ValueError, zipfile.BadZipFile)):
        bundle.unpack(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_requirements_are_read_and_checked_against_this_environment() -> None:
    text = "# pinned\nnumpy>=1.0  # arrays\n\n-r other.txt\npydantic\n"

    assert bundle.parse_requirements(text) == ["numpy>=1.0", "pydantic"]
    assert bundle.unmet_requirements(["numpy>=1.0", "pydantic", "torch; python_version < '3'"]) == []
    unmet = bundle.unmet_requirements(["apiary-no-such-package>=1", "numpy<1.0"])
    assert unmet[0] == "'apiary-no-such-package>=1': apiary-no-such-package is not installed"
    assert unmet[1].startswith("'numpy<1.0': numpy ") and unmet[1].endswith(" is installed")
    assert bundle.requirement_error("numpy>=") is not None
    assert bundle.requirement_error("numpy>=1") is None


def test_requirements_text_is_read_from_the_bundle_root(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    assert bundle.requirements_text(bundle.pack(root).data) is None

    (root / "requirements.txt").write_text("numpy\n")

    assert bundle.requirements_text(bundle.pack(root).data) == "numpy\n"
