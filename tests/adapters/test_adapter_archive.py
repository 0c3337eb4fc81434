"""Uploads as .zip / .tar.gz: extracted safely, rejected archives leave nothing behind."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapters import CONFIG, WEIGHTS, edit_tensors, files_under, key, make_adapter

from loraplex.adapters import AdapterValidationError, ArchiveLimits, LoRARequest, read_adapter


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("src") / "adapter")


def _tar(path: Path, members: list[tuple[str, bytes]], extra: list[tarfile.TarInfo] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tf.addfile(info)
    return path


def _zip(path: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def _files(folder: Path, prefix: str = "") -> list[tuple[str, bytes]]:
    return [(prefix + n, (folder / n).read_bytes()) for n in (CONFIG, WEIGHTS)]


def _reject(manager: Any, path: Path, store_dir: Path, reason: str, *words: str) -> None:
    with pytest.raises(AdapterValidationError) as info:
        manager.add_lora(LoRARequest("up", 1, str(path)))
    assert info.value.reason == reason, str(info.value)
    for word in words:
        assert word in str(info.value)
    assert manager.list_adapters() == []
    assert manager.num_free_slots == manager.config.max_loras
    assert files_under(store_dir) == [], f"left behind: {files_under(store_dir)}"
    manager.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zip_root", "zip_folder", "tar_root", "tar_folder"])
def test_valid_archives_load_with_the_directory_version(
    layout: str, adapter_dir: Path, tmp_path: Path, spec: Any, make_manager: Any, store_dir: Path
) -> None:
    prefix = "my-adapter/" if layout.endswith("folder") else ""
    members = [*_files(adapter_dir, prefix), (prefix + "README.md", b"hi")]
    if layout.startswith("zip"):
        path = _zip(tmp_path / "a.zip", list(members))
    else:
        path = _tar(tmp_path / "a.tar.gz", members)
    manager = make_manager()
    info = manager.add_lora(LoRARequest("up", 1, str(path)))
    assert info.version == read_adapter(adapter_dir, spec, 8, torch.float32).version
    assert info.folder == store_dir / info.version
    assert sorted(p.name for p in info.folder.iterdir()) == [CONFIG, WEIGHTS]  # README not extracted
    manager.acquire(1, "r")
    manager.release("r")
    manager.remove_lora(1)
    assert files_under(store_dir) == []
    manager.check_integrity()


def test_tar_path_traversal_is_rejected(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _tar(tmp_path / "a.tar.gz", [*_files(adapter_dir), ("../../evil.txt", b"x")])
    _reject(make_manager(), path, store_dir, "unsafe_archive", "../../evil.txt", "traversal")
    assert not (tmp_path / "evil.txt").exists() and not (store_dir.parent / "evil.txt").exists()


def test_zip_path_traversal_is_rejected(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _zip(tmp_path / "a.zip", [*_files(adapter_dir, "x/"), ("x/../../evil.txt", b"x")])
    _reject(make_manager(), path, store_dir, "unsafe_archive", "evil.txt", "traversal")


def test_absolute_member_is_rejected(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _tar(tmp_path / "a.tar.gz", [*_files(adapter_dir), ("/tmp/evil.txt", b"x")])
    _reject(make_manager(), path, store_dir, "unsafe_archive", "absolute")


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])
def test_tar_links_and_devices_are_rejected(
    kind: bytes, adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type = kind
    link.linkname = "/etc/passwd"
    path = _tar(tmp_path / "a.tar.gz", _files(adapter_dir)[:1], extra=[link])
    _reject(make_manager(), path, store_dir, "unsafe_archive", "adapter_model.safetensors")


def test_zip_symlink_is_rejected(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    link = zipfile.ZipInfo(WEIGHTS)
    link.external_attr = (0o120777 << 16) | 0
    path = _zip(tmp_path / "a.zip", [_files(adapter_dir)[0], (link, b"/etc/passwd")])
    _reject(make_manager(), path, store_dir, "unsafe_archive", "link")


def test_huge_member_is_rejected_from_its_header(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _tar(tmp_path / "a.tar.gz", [*_files(adapter_dir), ("pad.bin", b"\0" * 100_000)])
    manager = make_manager(archive_limits=ArchiveLimits(max_member_bytes=50_000, max_total_bytes=10**9))
    _reject(manager, path, store_dir, "archive_too_large", "pad.bin", "50000")


def test_total_size_and_member_count_limits(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _zip(tmp_path / "a.zip", [*_files(adapter_dir), *[(f"f{i}", b"") for i in range(10)]])
    _reject(
        make_manager(archive_limits=ArchiveLimits(max_members=5)), path, store_dir, "archive_too_large", "5"
    )
    total = sum(len(d) for _, d in _files(adapter_dir))
    limits = ArchiveLimits(max_total_bytes=total - 1)
    _reject(make_manager(archive_limits=limits), path, store_dir, "archive_too_large", str(total - 1))


def test_two_adapters_in_one_archive_is_ambiguous(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _zip(tmp_path / "a.zip", [*_files(adapter_dir, "a/"), *_files(adapter_dir, "b/")])
    _reject(make_manager(), path, store_dir, "bad_archive", "2 copies")


def test_pickle_only_archive_is_refused(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    path = _zip(tmp_path / "a.zip", [_files(adapter_dir)[0], ("adapter_model.bin", b"\x80\x04K\x01.")])
    _reject(make_manager(), path, store_dir, "pickle_format", "adapter_model.bin")


def test_corrupt_archive_is_rejected(tmp_path: Path, make_manager: Any, store_dir: Path) -> None:
    path = tmp_path / "a.zip"
    path.write_bytes(b"PK\x03\x04 definitely not a zip")
    _reject(make_manager(), path, store_dir, "bad_archive", "a.zip")
    tgz = tmp_path / "b.tar.gz"
    tgz.write_bytes(b"\x1f\x8b garbage")
    _reject(make_manager(), tgz, store_dir, "bad_archive", "b.tar.gz")


def test_invalid_weights_inside_a_safe_archive_leave_no_staging(
    adapter_dir: Path, tmp_path: Path, make_manager: Any, store_dir: Path
) -> None:
    bad = make_adapter(tmp_path / "bad")

    def poison(tensors: dict[str, Any]) -> None:
        tensors[key(0, "v_proj", "B")][0, 0] = float("nan")

    edit_tensors(bad, poison)
    path = _tar(tmp_path / "a.tar.gz", _files(bad, "bad/"))
    _reject(make_manager(), path, store_dir, "non_finite", "v_proj")
