"""The README's keys quickstart runs as written: a real ``loraplex serve`` in keys mode, a tenant
and a key from the CLI, an upload in the two-file form and a chat completion on the adapter.

The block is read from README.md (the one after the ``keys-quickstart`` marker) and run with
bash in a fresh folder with its own data dir. Three things change, and only these: the
``.venv/bin`` of this interpreter, a free port instead of 8000, and the demo adapter's
fine-tuning (minutes on a CPU) replaced by a small random PEFT folder of the same layout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.adapters import make_small_adapter
from support.ports import free_port

from loraplex.platform.model.source import resolve_model_dir

ROOT = Path(__file__).resolve().parents[3]
MARKER = "<!-- keys-quickstart"
DEMO_LINE = re.compile(r"^.*scripts/make_demo_adapters\.py.*$", re.MULTILINE)


def quickstart_block() -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(MARKER) :]
    match = re.search(r"```bash\n(.*?)```", after, re.DOTALL)
    assert match is not None, "no bash block after the keys-quickstart marker"
    return match.group(1)


@pytest.mark.slow
def test_readme_keys_quickstart_runs_as_written(tmp_path: Path) -> None:
    block = quickstart_block()
    assert DEMO_LINE.search(block), "the quickstart no longer makes the demo adapter"
    make_small_adapter(resolve_model_dir(None), tmp_path / "demo-adapters" / "pirate")
    port = str(free_port())
    script = DEMO_LINE.sub(": the demo adapter was made by the test", block)
    script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/").replace("8000", port)
    env = {
        **os.environ,
        "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    for name in ("LORAPLEX_AUTH", "LORAPLEX_DATABASE_URL", "LORAPLEX_ADAPTER_STORE", "LORAPLEX_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert '"owner":"acme"' in done.stdout and '"name":"pirate"' in done.stdout, done.stdout
    assert '"object":"chat.completion"' in done.stdout, done.stdout
