"""How much memory the CPU has left, inside a container too: its limit counts, and the page cache
the kernel can drop does not count as used (a container that has just read its checkpoint is
not full)."""

from __future__ import annotations

import pytest

from llm_foundry import machine

GiB, MiB = 2**30, 2**20


def _cgroup(root, limit: str, used: int, cache: int) -> None:
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{used}\n")
    (root / "memory.stat").write_text(f"anon {used - cache}\ninactive_file {cache}\nfile 0\n")


def test_a_container_limit_counts_and_its_page_cache_is_free(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "CGROUP", tmp_path)
    host = machine.memory_left("cpu")
    assert host is not None
    _cgroup(tmp_path, str(GiB), used=GiB - MiB, cache=800 * MiB)  # near the limit, mostly cache
    assert machine.memory_left("cpu") == min(host, GiB - (GiB - MiB - 800 * MiB))
    assert machine.memory_total("cpu") == (GiB, "the container's memory limit")
    _cgroup(tmp_path, "max", used=GiB, cache=0)  # no limit: the host's figures
    assert machine.memory_total("cpu")[1] == "RAM"
    assert machine.memory_left("cpu") == pytest.approx(host, rel=0.2)


def test_cgroup_v1_files_are_read_too(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "CGROUP", tmp_path)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (tmp_path / "memory" / "memory.stat").write_text(f"total_inactive_file {GiB // 2}\n")
    assert machine._cgroup() == (2 * GiB, GiB // 2)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert machine._cgroup() is None  # v1's "no limit"
