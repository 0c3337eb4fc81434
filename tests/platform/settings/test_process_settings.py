"""The process-wide switches (cache, cpu_kernels, amx, malloc_tuning) are settings: ``--print-settings``
shows them, and their effective value reaches the layers below the platform through the same
``LORAPLEX_*`` variable those layers have always read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from loraplex import paths
from loraplex.cli import main
from loraplex.cli import serve as serve_cli
from loraplex.kernels.cpu import build
from loraplex.platform.engine import host_memory
from loraplex.platform.settings import ProcessSettings, ServerSettings, all_fields, load_settings

SWITCHES = {
    "cache": paths.CACHE_ENV,
    "cpu_kernels": build.ENV_SWITCH,
    "amx": build.AMX_ENV_SWITCH,
    "malloc_tuning": host_memory.ENV_SWITCH,
}
"""Setting -> the variable its user reads."""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No LORAPLEX_* variable; whatever ``apply`` writes is undone, and so are the switches' caches."""
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)
    for name in SWITCHES.values():  # recorded as unset, so the teardown removes what apply wrote
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield
    build.clear_caches()
    host_memory.tune_host_malloc.cache_clear()


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split()[1]: line.split()[2:] for line in out.splitlines()[1:]}


def test_the_settings_use_the_variables_their_users_read() -> None:
    fields = all_fields()
    for name, env in SWITCHES.items():
        assert fields[name].section == "process" and fields[name].env == env
        assert fields[name].doc
    # The AMX switch is read by the C probe itself.
    source = (Path(build.__file__).parent / "quant_amx.c").read_text()
    assert f'getenv("{build.AMX_ENV_SWITCH}")' in source


def test_the_defaults_are_the_layers_own() -> None:
    """Unset, each layer behaves as the setting's default says (the defaults did not move)."""
    process = ServerSettings().process
    assert process == ProcessSettings(
        cache=Path.home() / ".cache" / "loraplex", cpu_kernels=True, amx=True, malloc_tuning=True
    )
    assert process.cache == paths.cache_root() == paths.default_cache_root()
    assert load_settings(environ={}).sources["cache"] == "default"


def test_print_settings_lists_every_switch_with_its_value_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--print-settings"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["cache"] == [str(Path.home() / ".cache" / "loraplex"), "default"]
    for name in ("cpu_kernels", "amx", "malloc_tuning"):
        assert rows[name] == ["True", "default"]

    config = tmp_path / "server.toml"
    config.write_text("[process]\nmalloc_tuning = false\n")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LORAPLEX_AMX", "0")
    assert main(["serve", "--print-settings", "--config-file", str(config), "--no-cpu-kernels"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["cache"] == [str(tmp_path / "cache"), "env", "LORAPLEX_CACHE"]
    assert rows["amx"] == ["False", "env", "LORAPLEX_AMX"]
    assert rows["malloc_tuning"] == ["False", "file", str(config)]
    assert rows["cpu_kernels"] == ["False", "flag", "--cpu-kernels"]


@pytest.mark.parametrize(
    ("text", "on"),
    [("0", False), ("off", False), (" FALSE ", False), ("no", False), ("1", True), ("ON", True)],
)
def test_the_variables_spell_a_switch_as_before(text: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", text)
    assert load_settings().settings.process.cpu_kernels is on
    assert load_settings(environ={"LORAPLEX_CPU_KERNELS": ""}).settings.process.cpu_kernels is True


def test_apply_hands_the_effective_values_to_the_layers_below(tmp_path: Path) -> None:
    # A flag over the environment, a file key: the layers see them as if set in the environment.
    config = tmp_path / "server.toml"
    config.write_text(f'cache = "{tmp_path / "c"}"\nmalloc_tuning = false\n')
    environ = {"LORAPLEX_AMX": "1", "LORAPLEX_CPU_KERNELS": "1", "LORAPLEX_CONFIG_FILE": str(config)}
    settings = load_settings({"amx": False, "cpu_kernels": "off"}, environ=environ).settings
    exported: dict[str, str] = {}
    settings.process.apply(exported)
    assert exported == {
        "LORAPLEX_CACHE": str(tmp_path / "c"),
        "LORAPLEX_CPU_KERNELS": "0",
        "LORAPLEX_AMX": "0",
        "LORAPLEX_MALLOC_TUNING": "0",
    }

    settings.process.apply()  # os.environ (the fixture undoes it)
    assert paths.cache_root() == tmp_path / "c"
    build.clear_caches()
    assert build.load_library() is None  # off: the torch path, no build
    host_memory.tune_host_malloc.cache_clear()
    assert host_memory.tune_host_malloc() is False


def test_serve_exports_the_switches_before_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.platform.engine import engine as engine_module

    seen: dict[str, str | None] = {}

    class Engine:
        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.update({env: os.environ.get(env) for env in SWITCHES.values()})
            raise ValueError("not starting an engine in this test")

    monkeypatch.setattr(engine_module, "LLMEngine", Engine)
    settings = load_settings({"cache": str(tmp_path), "amx": False}).settings
    with pytest.raises(typer.Exit):
        serve_cli.run_server(settings)
    assert seen == {
        "LORAPLEX_CACHE": str(tmp_path),
        "LORAPLEX_CPU_KERNELS": "1",
        "LORAPLEX_AMX": "0",
        "LORAPLEX_MALLOC_TUNING": "1",
    }
