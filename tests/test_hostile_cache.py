"""The compile cache and the binaries it hands out are untrusted files: a binary planted or changed
in the cache is never loaded, a cache folder others may write to is refused, and an LLM-written
template never builds host code. (Issue: treat every cache entry as hostile.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tuner.build import compile_source, render
from tuner.build.compile import file_digest, private_cache
from tuner.errors import UserError
from tuner.measure import LaunchSpec
from tuner.measure.candidates import BinaryRefused, load_candidate
from tuner.space import load_space

ROOT = Path(__file__).resolve().parent.parent
SPACE = load_space(ROOT / "space.yaml")


def test_a_cache_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError, match="writable by other users"):
        private_cache(shared)
    with pytest.raises(UserError, match="writable by other users"):
        compile_source("__global__ void k() {}", "sm_90a", cache_dir=shared)
    fresh = private_cache(tmp_path / "new" / "cache")
    assert fresh.stat().st_mode & 0o777 == 0o700


def test_a_planted_or_changed_binary_is_never_loaded(tmp_path):
    """The loader checks the bytes against the digest recorded at build time before cupy or
    ctypes sees them: a file at the predictable key is refused (a library's constructors would run
    on load), as is one without a digest. No GPU is needed: the refusal comes first."""
    planted = tmp_path / "0123abcd.so"
    planted.write_bytes(b"\x7fELF planted library")
    for artifact in ("library", "cubin"):
        with pytest.raises(BinaryRefused, match="not the binary that was built"):
            load_candidate(str(planted), LaunchSpec(artifact=artifact), digest="0" * 64)
        with pytest.raises(BinaryRefused, match="no recorded digest"):
            load_candidate(str(planted), LaunchSpec(artifact=artifact), digest=None)


@pytest.mark.nvcc
def test_a_cache_entry_changed_after_its_build_is_built_again(tmp_path):
    """A cache hit returns the binary only while its bytes still have the digest recorded when it
    was built; a file swapped in at the key (or an entry from a version that recorded none) is
    rebuilt, and the digest handed to the worker is always that of the fresh build."""
    src = '#include <cuda_fp16.h>\nextern "C" __global__ void hgemm(const __half*, const __half*, __half*, ' \
          'int, int, int, int) {}\n'
    first = compile_source(src, "sm_90a", cache_dir=tmp_path)
    assert first.ok and not first.cached and first.digest == file_digest(first.cubin)
    again = compile_source(src, "sm_90a", cache_dir=tmp_path)
    assert again.cached and again.digest == first.digest
    Path(first.cubin).write_bytes(b"planted")  # swapped at the predictable key
    rebuilt = compile_source(src, "sm_90a", cache_dir=tmp_path)
    assert rebuilt.ok and not rebuilt.cached and rebuilt.digest == first.digest
    assert file_digest(rebuilt.cubin) == first.digest
    (tmp_path / f"{first.key}.sha256").unlink()  # an entry without a recorded digest
    assert not compile_source(src, "sm_90a", cache_dir=tmp_path).cached


def test_an_untrusted_template_never_builds_host_code(tmp_path):
    """An LLM edits device code only: a library family (host + device, its host half runs in our
    process) marked untrusted is refused where every build starts (render), and in a space file."""
    fam = dataclasses.replace(SPACE.family("cute_sm90"), untrusted=True)
    with pytest.raises(UserError, match="device code only"):
        render(fam, fam.defaults(), "sm_90a")
    text = (ROOT / "space.yaml").read_text().replace("    artifact: library\n",
                                                     "    artifact: library\n    untrusted: true\n", 1)
    assert "untrusted: true" in text
    (tmp_path / "templates").symlink_to(ROOT / "templates")
    (tmp_path / "space.yaml").write_text(text)
    with pytest.raises(UserError, match="artifact: device code only|builds device code only"):
        load_space(tmp_path / "space.yaml")


def test_propose_refuses_a_library_family_before_asking_anyone(tmp_path):
    from proposer.loop import proposable, run_rounds

    with pytest.raises(UserError, match="host\\+device library"):
        proposable(SPACE, "cute_sm90")

    class NoClient:
        def chat(self, *a):  # pragma: no cover - must never be reached
            raise AssertionError("the endpoint was asked")

    with pytest.raises(UserError, match="host\\+device library"):
        run_rounds(SPACE, "cute_sm90", [], NoClient(), rounds=1, candidates=1, out_dir=tmp_path)
