"""Every verified vLLM release, checked from its own sources: the patch points, the workspace API,
and the lines of vLLM that wsd's ranks rely on.

The releases that cannot run here (``tests/vllm/vllm_releases.py``; their sources are
fetched by ``.ci/vllm-releases``) are read with ``ast``: no CUDA, no import. The
installed release is checked live by ``patches.check()``
(``tests/vllm/test_vllm_plugin.py``). I/O-free but for reading the cached sources.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from vllm_releases import SOURCE_RELEASES, source_root

from wsd.integrations.vllm import compat
from wsd.integrations.vllm.patches import CHECKED_VERSIONS, POINTS


def _root(release: str) -> Path:
    root = source_root(release)
    if root is None:
        pytest.skip(f"vLLM {release}'s sources are not fetched here: .ci/vllm-releases fetches them "
                    f"(and .ci/run runs it)")
    return root


def _wsd_api() -> compat.Api:
    pytest.importorskip("torch", reason="wsd's stand-in module is torch's")
    import wsd.integrations.vllm.workspace as wsd_workspace

    return compat.live(wsd_workspace)


def test_the_releases_checked_at_source_level_are_the_verified_ones_but_the_installed():
    assert set(SOURCE_RELEASES) == set(CHECKED_VERSIONS) - {"0.32.0"} and SOURCE_RELEASES


@pytest.mark.parametrize("release", SOURCE_RELEASES)
@pytest.mark.parametrize("point", [p for p in POINTS if p.vllms], ids=lambda p: f"{p.module}.{p.path}")
def test_every_patch_point_is_in_the_release_with_the_parameters_wsd_relies_on(release, point):
    params = compat.source_params(_root(release), point.module, point.path)
    if point.optional and params is None:
        return  # wrapped where vLLM has it: this release has not
    if point.kind == "contextvar":
        assert params is None, f"{point.path} is defined, not assigned: not a context variable"
    else:
        assert params is not None and params.positional[: len(point.params)] == point.params, params


@pytest.mark.parametrize("release", SOURCE_RELEASES)
def test_wsds_stand_in_offers_everything_the_releases_workspace_module_does(release):
    """vLLM 0.34 added get_retained: with wsd's class in vLLM's place, DeepSeek V4.1 raised
    AttributeError. A release whose module has anything wsd's lacks fails here first."""
    theirs = compat.source(_root(release) / "vllm" / "v1" / "worker" / "workspace.py")
    assert "WorkspaceManager" in theirs.methods and "get_simultaneous" in theirs.methods["WorkspaceManager"]
    assert compat.gaps(theirs, _wsd_api()) == []


# What vLLM computes and wsd's ranks take as they are (wsd.integrations.vllm.layout.placement):
# the world group's rank offset by the DP rank and its world widened across DP where DP ranks
# share a world, and a dense DP replica reset to a world of its own.
RANK_LINES = {
    ("vllm", "distributed", "parallel_state.py"): [
        "rank = parallel_config.data_parallel_rank * world_size + rank",
        "world_size = parallel_config.world_size_across_dp",
    ],
    ("vllm", "v1", "engine", "core.py"): ["parallel_config.reconfigure_for_independent_dp_rank()"],
    ("vllm", "config", "parallel.py"): ["self.pipeline_parallel_size * self.tensor_parallel_size"
                                        " * self.prefill_context_parallel_size"],
}


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("(\n", "(").replace("\n)", ")"))


@pytest.mark.parametrize("release", SOURCE_RELEASES)
@pytest.mark.parametrize("file", list(RANK_LINES), ids=lambda f: "/".join(f))
def test_the_lines_wsds_ranks_rely_on_are_in_the_release(release, file):
    text = _normalised(_root(release).joinpath(*file).read_text())
    for line in RANK_LINES[file]:
        assert _normalised(line) in text, f"{'/'.join(file)} of vLLM {release} lacks {line!r}"


# -- the checks themselves: each finds what it is there to find ---------------------------------------


def test_a_moved_patch_point_is_named(tmp_path):
    release = SOURCE_RELEASES[-1]
    root = tmp_path / "vllm-moved"
    source = _root(release) / "vllm" / "v1" / "worker" / "gpu_worker.py"
    target = root / "vllm" / "v1" / "worker" / "gpu_worker.py"
    target.parent.mkdir(parents=True)
    shutil.copy(source, target)
    target.write_text(target.read_text().replace("def execute_dummy_batch(", "def run_dummy_batch("))
    with pytest.raises(LookupError, match="execute_dummy_batch"):
        compat.source_params(root, "vllm.v1.worker.gpu_worker", "Worker.execute_dummy_batch")
    assert compat.source_params(root, "vllm.v1.worker.gpu_worker", "Worker.execute_model") is not None


def test_what_a_workspace_module_adds_is_named(tmp_path):
    """vllm-project/vllm#58161 adds use_workspace_ubatch_id(); #46883 a persistent lease: a
    class swap would silently ignore either."""
    release = SOURCE_RELEASES[-1]
    module = tmp_path / "workspace.py"
    module.write_text(
        (_root(release) / "vllm" / "v1" / "worker" / "workspace.py").read_text()
        + "\n\ndef use_workspace_ubatch_id(ubatch_id: int):\n    pass\n"
        + "\n\nclass WorkspaceManager(WorkspaceManager):\n"
          "    def get_simultaneous(self, *shapes_and_dtypes, lease=None):\n        pass\n\n"
          "    def lease(self, key):\n        pass\n")
    assert compat.gaps(compat.source(module), _wsd_api()) == [
        "WorkspaceManager.get_simultaneous(*, lease)", "WorkspaceManager.lease", "use_workspace_ubatch_id"]
